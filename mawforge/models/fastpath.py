"""The one-token (M=1) attention step of the standard GQA layer in one native call.

A resident decode step on a small CPU spends a large share of its time crossing from Python
into C and making small tensors: before the KV append, `MoETransformer.attention` makes three
projections, two q/k RMSNorms and two RoPEs, each its own call with its own tensors. Here they
are one call (kernels/native/decode_step.c attn_qkv) into one reused buffer, computed by the same
C kernels on the same inputs, so q, k and v are the same bits as the separate calls give.

It is taken only where that holds: native kernels loaded, a CPU model, GGUF q/k/v rows of a type
the kernels take, float32 norm weights and biases, the shared `attention`, `qk_norm`, `proj` and
`Rope` (an architecture that overrides one of them computes its own way and never gets here),
and one float32 token. Anything else runs the separate calls, as before.

Legend: C hidden, H query heads, G kv heads, D head dim.
"""
from __future__ import annotations

import torch

from mawforge.kernels import native

NORM_KIND = {"none": 0, "head": 1, "full": 2}


def _native_rows(w) -> tuple | None:
    """(raw rows, GGML type) of a weight the native gemm takes, else None."""
    if getattr(w, "codec", None) != "ggml" or w.device.type != "cpu" or not native.available(w.ggml_type):
        return None
    return w.parts["blocks"].contiguous(), int(w.ggml_type)


def _f32_vector(t, n: int) -> bool:
    return (isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.dim() == 1 and t.numel() == n
            and t.is_contiguous() and t.device.type == "cpu")


class DecodeAttention:
    """Per layer, the bound arguments of the fused call; `qkv(layer, x, pos)` -> q [1, H, D],
    k [1, G, D], v [1, G, D] (views of one buffer that the next call overwrites)."""

    def __init__(self, model, layers: list[tuple]):
        cfg = model.cfg
        self.heads = (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)
        self.rope, self.layers = model.rope, layers
        h, g, d = self.heads
        self.out = torch.empty((h + 2 * g) * d, dtype=torch.float32)
        self.q = self.out[:h * d].view(1, h, d)
        self.k = self.out[h * d:(h + g) * d].view(1, g, d)
        self.v = self.out[(h + g) * d:].view(1, g, d)

    @classmethod
    def plan(cls, model) -> DecodeAttention | None:
        """The fast path for this model, or None where any of its conditions does not hold."""
        from mawforge.models.base import MoETransformer, Rope
        t = type(model)
        if (model.device.type != "cpu" or not native.available() or type(model.rope) is not Rope
                or any(getattr(t, f) is not getattr(MoETransformer, f)
                       for f in ("attention", "qk_norm", "proj", "mixer"))):
            return None
        cfg, w = model.cfg, model.w
        h, g, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        kind = NORM_KIND.get(cfg.qk_norm)
        if kind is None or (cfg.args.kv_layers and any(s.get("kind") != "kv" or s.get("window")
                                                       for s in cfg.args.kv_layers)):
            return None
        norm_n = {0: (0, 0), 1: (d, d), 2: (h * d, g * d)}[kind]
        layers = []
        for layer in range(cfg.n_layers):
            p = f"blk.{layer}."
            names = [p + f"attn_{s}.weight" for s in "qkv"]
            if not all(w.has(n) for n in names):
                return None
            ws = [_native_rows(w.packed(n)) for n in names]
            biases = [w.maybe_dense(n.replace(".weight", ".bias")) for n in names]
            if any(r is None for r in ws) or any(b is not None and not _f32_vector(b, n)
                                                for b, n in zip(biases, (h * d, g * d, g * d))):
                return None
            nq = nk = None
            if kind:
                nq, nk = w.maybe_dense(p + "attn_q_norm.weight"), w.maybe_dense(p + "attn_k_norm.weight")
                if not (_f32_vector(nq, norm_n[0]) and _f32_vector(nk, norm_n[1])):
                    return None
            layers.append((tuple(ws), tuple(biases), (kind, nq, nk, float(cfg.norm_eps))))
        return cls(model, layers)

    def qkv(self, layer: int, x: torch.Tensor, pos: torch.Tensor):
        cos, sin = self.rope.at(int(pos[0]))
        ws, biases, norm = self.layers[layer]
        native.attn_qkv(x.contiguous(), ws, biases, self.heads, norm, cos, sin, self.rope.layout == "neox", self.out)
        return self.q, self.k, self.v
