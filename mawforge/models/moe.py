"""The MoE block: routed experts computed on the blocks the expert cache holds.

The cache decides and accounts (hits, misses, evictions, prefetch, bytes); it yields, per group
of a layer's routed experts, the keys whose blocks are resident, and this block computes them.
What one expert computes is the model's `expert_fn` (None: SwiGLU); with plain SwiGLU over GGUF
blocks the native kernel computes a whole group in one call.

Legend: T tokens, C hidden, k experts per token, n tokens routed to one expert.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from mawforge.kernels import cpu as kernels, linear, native
from mawforge.models.miss_policy import MissPolicy


def swiglu_expert(x: torch.Tensor, parts: dict) -> torch.Tensor:
    """One expert on its tokens. parts: kind -> PackedWeight (gate, up, down or gate_up, down)."""
    if "gate_up" in parts:
        gu = linear(x, parts["gate_up"])
        g, u = gu.chunk(2, dim=-1)
    else:
        g, u = linear(x, parts["gate"]), linear(x, parts["up"])
    return linear(torch.nn.functional.silu(g.float()) * u.float(), parts["down"]).float()


class MoEBlock:
    """`experts(layer, x, idx, w)` for a model: x [T, C], idx/w [T, k] -> [T, C], the weighted
    sum of each token's routed experts. `expert_fn()` gives the model's per-expert function."""

    # bound native arguments per resident block, so a decode step does not re-derive the types
    # and 24 pointers of a layer's experts: id(parts) -> (parts, types, (gate, up, down) pointers).
    # The entry holds `parts`, so its id is not reused while it is here; a block the cache
    # re-binds gets a new parts dict and a new entry. Cleared when it grows past MEMO_MAX.
    MEMO_MAX = 1 << 14

    def __init__(self, cache, expert_fn: Callable[[], Callable | None]):
        self.cache, self.expert_fn = cache, expert_fn
        self._memo: dict[int, tuple] = {}
        self.ahead = 0              # router lookahead: layers ahead (0: off); set by the runtime
        # a batch's coordinator (engine/batch.py): gate(layer, x, idx, w) -> the rows' output once
        # the block has run over every sequence of the step, or None to compute here at once
        self.gate: Callable | None = None
        # decode's miss policy (models/miss_policy.py; exact by default), and what it needs of the
        # model: the router logits of a layer's FFN input, and whether top-k weights are renormalized
        self.miss = MissPolicy()
        self.router_logits: Callable[[int, torch.Tensor], torch.Tensor] | None = None
        self.renorm = True

    def lookahead(self, layer: int, x: torch.Tensor, route: Callable, n_layers: int, dense: Sequence[int]) -> None:
        """Before this layer's experts: apply layer+ahead's router (at layer 0, and in a prefill
        wave at every layer, also the nearer ones') to this layer's FFN input x [T, C] and
        prefetch what it would pick, in one plan sparing every layer from this one on.
        `route(layer, x) -> (idx, w)` is the model's.

        A wave's tokens reach experts no lookahead two layers back picked (a few tokens each);
        asking again one layer ahead, from the nearer input, turns some of those demand misses
        into reads that have a layer's compute to arrive in, and probes the rest (already
        asked for). Inside 8 GiB on the 48-layer file, 250-token turns after 2,014 cached tokens
        (AMD EPYC Zen 5): misses 174-182 -> 131-145 a turn, the compute's wait on them 0.58-0.86
        -> 0.42-0.63 s, turns 4-7% faster (alternating runs); one token (decode) keeps the
        single lookahead (runtime.LOOKAHEAD's note)."""
        if not self.ahead or not self.cache.driver.enabled:
            return                  # off, or a measuring window with prefetch off
        keys, widest = [], 0
        near = layer + 1 if layer == 0 or x.shape[0] > 1 else layer + self.ahead
        for nxt in range(near, layer + self.ahead + 1):
            if nxt >= n_layers or nxt in dense:
                continue            # no such layer, or no router there
            idx, _ = route(nxt, x)                                                     # [T, k]
            picked = sorted(set(idx[0].tolist())) if idx.shape[0] == 1 else torch.unique(idx).tolist()
            keys += [(nxt, e) for e in picked]
            widest = max(widest, sum(self.cache.block_bytes(nxt, e) for e in picked))
        # a prefill wave routes to most of a layer's experts: where the cache cannot hold this
        # layer's, the next one's and the looked-ahead one's at once, the prefetched blocks would
        # take the room this layer's misses need and be evicted unused, read twice
        if keys and (x.shape[0] == 1 or (self.ahead + 1) * widest <= self.cache.capacity):
            self.cache.lookahead(keys)

    def __call__(self, layer: int, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self.gate is not None:
            y = self.gate(layer, x, idx, w)
            if y is not None:
                return y
        return self.compute(layer, x, idx, w)

    def compute(self, layer: int, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The block over x's rows now: one cache request for the union of their experts."""
        fn = self.expert_fn()
        plain = fn is None
        fn = fn or swiglu_expert
        idx_np = idx.cpu().numpy()
        w_np = w.float().cpu().numpy()
        if self.miss.lossy and self.cache.driver.kind == "decode":
            idx_np, w_np = self._lossy(layer, x, idx_np, w_np)
            idx, w = torch.from_numpy(idx_np), torch.from_numpy(w_np)
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        for keys in self.cache.resident(layer, idx_np, w_np):
            if plain and self._fused(x, keys, idx_np, w_np, out):
                continue
            if x.shape[0] == 1:      # decode: no gather/scatter, one weighted sum
                for key in keys:
                    j = int(np.flatnonzero(idx_np[0] == key[1])[0])
                    out += fn(x, self.cache.weights(key)) * w_np[0, j]
                continue
            for key in keys:
                tok, slot_k = np.nonzero(idx_np == key[1])
                t = torch.from_numpy(tok).to(x.device)
                y = fn(x.index_select(0, t), self.cache.weights(key))                 # [n, C]
                y = y * w.index_select(0, t).gather(1, torch.from_numpy(slot_k).to(x.device)[:, None]).float()
                out.index_add_(0, t, y)
        return out

    def _lossy(self, layer: int, x: torch.Tensor, idx_np: np.ndarray, w_np: np.ndarray):
        logits = None
        if self.router_logits is not None:
            logits = lambda: self.router_logits(layer, x).float().cpu().numpy()  # noqa: E731
        return self.miss.apply(layer, idx_np, w_np, self.cache.holds, logits, self.renorm)

    def _fused(self, x: torch.Tensor, keys, idx_np: np.ndarray, w_np: np.ndarray, out: torch.Tensor) -> bool:
        """All of a group's experts in one native call (decode, verify, and prefill chunks of up to
        NATIVE_MAX_M tokens), where the blocks are GGUF types the native kernels take. Returns
        False (nothing done) otherwise."""
        if not keys or x.shape[0] > kernels.NATIVE_MAX_M:
            return False
        bound = [self._bound(self.cache.weights(key)) for key in keys]
        types, f = bound[0][1], bound[0][3]
        if types is None or any(b[1] != types or b[3] != f for b in bound):
            return False
        batch = native.ExpertBatch(types, f, x.shape[1])
        for b in bound:
            batch.add(*b[2])
        if x.shape[0] == 1:      # decode: one pair per expert
            slot_of = {int(e): j for j, e in enumerate(idx_np[0])}
            wt = np.array([w_np[0, slot_of[e]] for _, e in keys], dtype=np.float32)
            pairs = (np.arange(len(keys) + 1, dtype=np.int32), np.zeros(len(keys), np.int32), wt)
            native.moe_ffn(x, batch, None, out, pairs)
            return True
        experts = np.array([e for _, e in keys])
        hit = idx_np[None, :, :] == experts[:, None, None]                     # [E, T, k]
        wts = (hit * w_np[None]).sum(-1, dtype=np.float32)                     # [E, T]
        native.moe_ffn(x, batch, wts, out)
        return True

    def _bound(self, parts: dict) -> tuple:
        """(parts, GGUF types or None, (gate, up, down) pointers, F) of one resident block."""
        hit = self._memo.get(id(parts))
        if hit is not None and hit[0] is parts:
            return hit
        types = kernels.native_swiglu_types(parts, 1)
        ptrs, f = None, None
        if types is not None:
            f = parts["down"].shape[1]
            rows = kernels.native_rows
            if "gate_up" in parts:
                g = rows(parts["gate_up"])
                ptrs = (g.data_ptr(), g[f:].data_ptr(), rows(parts["down"]).data_ptr())
            else:
                ptrs = (rows(parts["gate"]).data_ptr(), rows(parts["up"]).data_ptr(), rows(parts["down"]).data_ptr())
        if len(self._memo) >= self.MEMO_MAX:
            self._memo.clear()
        hit = self._memo[id(parts)] = (parts, types, ptrs, f)
        return hit
