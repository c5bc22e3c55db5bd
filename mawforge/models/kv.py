"""Per-layer state preallocated for the whole context at load, so its bytes are known up front.

Attention layers keep a KV cache that grows with the context; recurrent layers (gated delta-net)
keep fixed-size float32 state tensors. The layout comes from `config.args.kv_layers`
(see formats/config.py); without it every layer is an attention layer of the config's shape.

Rolling back is free for attention (positions past n are simply overwritten later). Recurrent
state holds no positions, so a speculative verify step brackets its forward with `mark()`:
each recurrent layer's state is copied once (into buffers reused by every mark), and each chunk
the layer runs leaves a replay function for its inputs. `truncate(n)` to any position since the
mark restores the copy and replays the first n - mark tokens: the same float operations in the
same order as the forward ran them, so the state is bit-identical to the one it had there.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

import torch

from mawforge.byte_rules import kv_row_bytes, layer_state
from mawforge.errors import ContextLengthError, UnsupportedError
from mawforge.kernels import q8_0


# a chunk's replay: advance(state, m) runs the chunk's first m tokens on the layer's state tensors
Replay = Callable[[list[torch.Tensor], int], None]


def layer_layout(cfg) -> list[dict]:
    """Per layer: {"kind": "kv", "kv_heads", "head_dim"}, {"kind": "latent", "dim"},
    {"kind": "recurrent", "state": [shapes]} or {"kind": "none"} (a layer this cache does not hold)."""
    return list(cfg.args.kv_layers or
                [{"kind": "kv", "kv_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim}] * cfg.n_layers)


def kv_storage(dtype: torch.dtype | str) -> tuple[str, torch.dtype]:
    """A KV dtype (its name, as plan.kv_dtype, or a torch float dtype) -> (name, the torch dtype its
    rows are stored in: uint8 for q8_0's blocks)."""
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if name == "q8_0":
        return name, torch.uint8
    kv_row_bytes(1, name)           # an unknown name is an error here, as in the plan
    return name, getattr(torch, name)


class KVCache:
    # k[layer], v[layer]: [G, ctx, D] (None for recurrent layers; a q8_0 cache's rows are uint8
    # [G, ctx, D / 32 * 34], kernels/q8_0.py); state[layer]: list of f32 tensors
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, context: int,
                 dtype: torch.dtype | str, device: torch.device, layout: list[dict] | None = None):
        self.context = context
        self.kv_dtype, store = kv_storage(dtype)
        self.quant = self.kv_dtype == "q8_0"
        # q8_0 rows of keys and values rotated as llama.cpp rotates them (kernels/q8_0.py): where the
        # model's head dim is a multiple of 64 (llama.cpp decides by it; each layer whose dim is)
        self.rotated = self.quant and head_dim % 64 == 0
        layout = layout or [{"kind": "kv", "kv_heads": n_kv_heads, "head_dim": head_dim}] * n_layers
        self.k: list[torch.Tensor | None] = []
        self.v: list[torch.Tensor | None] = []
        self.state: list[list[torch.Tensor] | None] = []
        for spec in layout:                 # the shapes plan.py counts (byte_rules.layer_state, kv_row_bytes)
            grow = [torch.zeros(*shape[:-1], kv_row_bytes(shape[-1], self.kv_dtype) // store.itemsize, dtype=store,
                                device=device) for shape, g in layer_state(spec, context) if g]
            fixed = [torch.zeros(*shape, dtype=torch.float32, device=device)
                     for shape, g in layer_state(spec, context) if not g]
            self.k.append(grow[0] if grow else None)           # MLA: one compressed row per position, no v
            self.v.append(grow[1] if len(grow) > 1 else None)
            self.state.append(fixed if spec["kind"] == "recurrent" else None)
        self.pos = 0            # committed positions
        self.kept = 0           # leading positions not truncated away since the prompt cache noted them
        self.trail: dict[int, list[tuple[int, Replay]]] | None = None   # layer -> chunks since mark()
        self.trail_start = 0
        self.fast = None        # a batch sequence's own fused decode path (engine/batch.py), bound to this cache
        self._snap: dict[int, list[torch.Tensor]] = {}                  # recurrent state at mark()

    @classmethod
    def for_config(cls, cfg, context: int, dtype: torch.dtype | str, device: torch.device) -> "KVCache":
        return cls(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, context, dtype, device, layer_layout(cfg))

    @property
    def nbytes(self) -> int:
        kv = sum(t.nbytes for t in self.k + self.v if t is not None)
        return kv + sum(t.nbytes for s in self.state if s is not None for t in s)

    @property
    def recurrent(self) -> bool:
        return any(s is not None for s in self.state)

    @property
    def rollback_bytes(self) -> int:
        """Bytes of the state copies that mark() keeps (allocated on the first mark; 0 without recurrent layers)."""
        return sum(t.nbytes for s in self._snap.values() for t in s)

    def check_room(self, n: int) -> None:
        if self.pos + n > self.context:
            raise ContextLengthError(f"{self.pos + n} tokens exceed the context of {self.context}")

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [T, G, D] at the uncommitted positions; return the layer's [G, S, D] views (a
        q8_0 cache's rows are of the rotated k and v, kernels/q8_0.py: rows_float gives their values
        in that basis, models/base.attend rotates q and the output to match)."""
        T = k.shape[0]
        end = self.pos + T
        kc, vc = self.k[layer], self.v[layer]
        k, v = k.transpose(0, 1), v.transpose(0, 1)
        if self.rotated:
            k, v = q8_0.rot_k(k), q8_0.rot_v(v)
        if self.quant:
            k, v = q8_0.quantize(k), q8_0.quantize(v)
        kc[:, self.pos:end].copy_(k)      # copy_ converts as .to() does, in place
        vc[:, self.pos:end].copy_(v)
        return kc[:, :end], vc[:, :end]

    def append_latent(self, layer: int, c: torch.Tensor) -> torch.Tensor:
        """MLA: write latent rows c [T, R] at the uncommitted positions (q8_0: not rotated); return
        the layer's [S, R] stored rows."""
        end = self.pos + c.shape[0]
        kc = self.k[layer]
        kc[self.pos:end].copy_(q8_0.quantize(c) if self.quant else c)
        return kc[:end]

    def layer_state(self, layer: int) -> list[torch.Tensor]:
        """The recurrent layer's fixed state tensors, updated in place by the model."""
        return self.state[layer]

    def commit(self, n: int) -> None:
        self.pos += n

    @contextmanager
    def ahead(self, n: int):
        """Inside the block, appends write n positions past the committed ones: a layer-major
        prefill runs a layer's chunks in order before committing them all (models/base.py mix)."""
        pos = self.pos
        self.pos = pos + n
        try:
            yield
        finally:
            self.pos = pos

    # ---- rollback of recurrent state ----------------------------------------------------
    def mark(self) -> None:
        """Make every position from here on a point `truncate` can return to (until unmark())."""
        if not self.recurrent:
            return
        for layer, s in enumerate(self.state):
            if s:
                if layer not in self._snap:
                    self._snap[layer] = [torch.empty_like(t) for t in s]
                for dst, src in zip(self._snap[layer], s):
                    dst.copy_(src)
        self.trail, self.trail_start = {}, self.pos

    def unmark(self) -> None:
        self.trail = None

    def recorder(self, layer: int) -> list[tuple[int, Replay]] | None:
        """Where a recurrent layer appends (tokens, replay) for each chunk it runs; None when unmarked."""
        return None if self.trail is None else self.trail.setdefault(layer, [])

    def can_truncate(self, n: int) -> bool:
        return (n >= self.pos or n == 0 or not self.recurrent
                or (self.trail is not None and n >= self.trail_start))

    def truncate(self, n: int) -> None:
        """Forget positions >= n (speculative rollback, or a new request). Recurrent state returns
        to the start, or to any position since mark(); the mark ends either way."""
        self.kept = min(self.kept, n)
        if n >= self.pos:
            return
        if self.recurrent:
            if not self.can_truncate(n):
                raise UnsupportedError("cannot roll back recurrent (delta-net) state to a position before "
                                       "the last mark (or with none)")
            if n == 0:
                for s in self.state:
                    for t in s or ():
                        t.zero_()
            else:
                self._rewind(n - self.trail_start)
            self.trail = None
        self.pos = n

    def _rewind(self, m: int) -> None:
        for layer, snap in self._snap.items():
            state = self.state[layer]
            for dst, src in zip(state, snap):
                dst.copy_(src)
            left = m
            for tokens, replay in self.trail.get(layer, ()):
                if left <= 0:
                    break
                replay(state, min(tokens, left))
                left -= tokens
            if left > 0:
                raise UnsupportedError(f"layer {layer} ran {m - left} tokens since the mark, not {m}: cannot roll back")

    # ---- the prompt cache's copies (engine/prompt_reuse.py) ----------------------------
    def _growing(self) -> list[torch.Tensor]:
        return [t for pair in zip(self.k, self.v) for t in pair if t is not None]

    def export_rows(self, n: int) -> list[torch.Tensor]:
        """Copies of the first n positions of every layer's k, v or latent rows."""
        return [_head(t, n).clone() for t in self._growing()]

    def import_rows(self, rows: list[torch.Tensor], n: int) -> None:
        """Start over at position n from export_rows copies (of n positions or more); recurrent
        state is zeroed: import_state sets it."""
        self.truncate(0)
        for t, r in zip(self._growing(), rows):
            _head(t, n).copy_(_head(r, n))
        self.pos = n

    def export_state(self) -> list[list[torch.Tensor]]:
        """Copies of every recurrent layer's state (empty without recurrent layers)."""
        return [[t.clone() for t in s] for s in self.state if s]

    def import_state(self, saved: list[list[torch.Tensor]]) -> None:
        for s, src in zip((s for s in self.state if s), saved):
            for dst, x in zip(s, src):
                dst.copy_(x)


def _head(t: torch.Tensor, n: int) -> torch.Tensor:
    """The first n positions of a growing tensor: kv [G, ctx, D], latent [ctx, R]."""
    return t[:, :n] if t.dim() == 3 else t[:n]
