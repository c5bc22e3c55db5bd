"""Multi-token prediction (nextn) drafting for the architectures whose checkpoints keep an MTP
block after their last layer (Qwen3.5/3.6-MoE, DeepSeek-V3), stored as llama.cpp's layer
n_layers and packed as common tensors, its routed experts included.

One MTP step reads the target's final hidden state at position j and the token at j+1, and
predicts the token at j+2: `model.mtp_step(hidden, tokens, pos0, kv) -> (hidden', logits)`.
Its attention has its own KV cache with one row per position j, built from the target's hidden
states, so the target's forwards keep theirs (`keep_hidden`) while MTP drafting is enabled.
Drafting k tokens chains k steps, each reading the hidden state the previous step returned.

    model.enable_mtp(context, dtype)           # once: the target starts keeping hidden states
    drafts, q = model.mtp_propose(context, k, sampler)

Legend: T tokens, C hidden, V vocab, N expert rows (ff), K row length, k experts per token.
"""
from __future__ import annotations

import torch

from mawforge.models.kv import KVCache
from mawforge.codecs import quants
from mawforge.models.moe import swiglu_expert

_ROW_CODECS = ("ggml", "f32", "f16", "bf16")     # parts are row-major [rows, ...]: an expert is a row slice


class MtpState:
    """The MTP block's KV cache, the tokens it was fed, and the target's hidden states it has not
    consumed yet. MTP position j pairs the target's hidden state at j with context[j + 1]."""

    def __init__(self, kv: KVCache) -> None:
        self.kv = kv
        self.inputs: list[int] = []       # the token fed at each MTP position
        self.valid = 0                    # positions built from the target's hidden states (the rest were chained)
        self.log: list[tuple[int, torch.Tensor]] = []   # (first position, final hidden rows [T, C])

    def keep(self, pos0: int, h: torch.Tensor) -> None:
        """A target forward ran positions pos0..: its rows replace anything kept from pos0 on."""
        self.log = [(p, r[:pos0 - p]) for p, r in self.log if p < pos0]
        self.log.append((pos0, h))

    def rows(self, start: int, end: int) -> torch.Tensor | None:
        parts, at = [], start
        for p, r in self.log:
            if p <= at < p + r.shape[0]:
                parts.append(r[at - p:end - p])
                at += parts[-1].shape[0]
        return torch.cat(parts) if at >= end else None

    def _drop_before(self, pos: int) -> None:
        self.log = [(max(p, pos), r[max(0, pos - p):]) for p, r in self.log if p + r.shape[0] > pos]

    def propose(self, model, context: list[int], k: int, sampler=None):
        """Up to k drafts following `context` (the target has run all but its last token), and
        their distributions q ([V] each) when sampling, None when greedy."""
        n = len(context) - 1
        if k < 1 or n < 1:
            return [], None
        common = 0
        for a, b in zip(self.inputs[:self.valid], context[1:]):
            if a != b:
                break
            common += 1
        common = min(common, n - 1)            # the last pair is re-run for its output
        h = self.rows(common, n)
        if h is None:                          # the target ran these positions before MTP was enabled
            return [], None
        self.kv.truncate(common)
        del self.inputs[common:]
        greedy = sampler is None or sampler.greedy
        drafts, qs = [], []
        with torch.inference_mode():
            toks = context[common + 1:n + 1]
            hid, logits = self._step(model, h, toks)
            self.valid = n
            for i in range(k):
                q = None if greedy else sampler.probs(logits[-1])
                d = int(torch.argmax(logits[-1])) if greedy else sampler.draw(q)
                drafts.append(d)
                qs.append(q)
                if i + 1 == k or self.kv.pos >= self.kv.context:
                    break
                hid, logits = self._step(model, hid[-1:], [d])
        self._drop_before(self.valid)
        return drafts, (None if greedy else qs)

    def _step(self, model, hidden: torch.Tensor, toks: list[int]):
        t = torch.tensor(toks, dtype=torch.long, device=hidden.device)
        out = model.mtp_step(hidden, t, self.kv.pos, self.kv)
        self.kv.commit(len(toks))
        self.inputs += toks
        return out


class MtpMixin:
    """has_mtp / enable_mtp / mtp_propose for a model class that defines `mtp_cache(context, dtype)`
    and `mtp_step(hidden, tokens, pos0, kv)`; the base loop calls `keep_hidden(pos0, h)` while
    `keeps_hidden()`."""

    mtp: MtpState | None = None

    def mtp_cache(self, context: int, dtype: torch.dtype = torch.float32):
        """The MTP layer's own one-layer KV cache (its layer index is n_layers), full attention
        over the model's KV heads; a family whose MTP layer keeps something else overrides it."""
        c = self.cfg
        layout = [{"kind": "none"}] * c.n_layers + [{"kind": "kv", "kv_heads": c.n_kv_heads, "head_dim": c.head_dim}]
        return KVCache(c.n_layers + 1, c.n_kv_heads, c.head_dim, context, dtype, self.device, layout)

    @property
    def has_mtp(self) -> bool:
        L = self.cfg.n_layers
        return self.cfg.args.mtp_layers > 0 and self.w.has(f"blk.{L}.nextn.eh_proj.weight")

    def enable_mtp(self, context: int, dtype: torch.dtype | str = torch.float32) -> MtpState:
        self.mtp = MtpState(self.mtp_cache(context, dtype))
        return self.mtp

    def disable_mtp(self) -> None:
        self.mtp = None

    def keeps_hidden(self) -> bool:
        return self.mtp is not None

    def keep_hidden(self, pos0: int, h: torch.Tensor) -> None:
        if self.mtp is not None:
            self.mtp.keep(pos0, h)

    def mtp_propose(self, context: list[int], k: int, sampler=None):
        if self.mtp is None:
            raise RuntimeError("mtp_propose before enable_mtp: the target's hidden states were not kept")
        return self.mtp.propose(self, context, k, sampler)

    def mtp_experts(self, layer: int, x: torch.Tensor, idx: torch.Tensor, wts: torch.Tensor) -> torch.Tensor:
        """The MTP block's routed experts from common tensors, SwiGLU. x [T, C], idx, wts [T, k] -> [T, C]."""
        out = torch.zeros_like(x)
        for e in torch.unique(idx).tolist():
            rows, slot = (idx == e).nonzero(as_tuple=True)
            parts = {kind: w for kind in ("gate", "up", "down", "gate_up")
                     if (w := self._common_expert(layer, kind, e)) is not None}
            out.index_add_(0, rows, swiglu_expert(x[rows], parts) * wts[rows, slot, None])
        return out

    def _common_expert(self, layer: int, kind: str, e: int) -> quants.PackedWeight | None:
        """One expert of a common expert tensor: per-expert blk.L.ffn_{kind}.E, or a row slice of
        the 3-D blk.L.ffn_{kind}_exps (dequantized once for codecs that reorder rows)."""
        lw, per, fused = self.layers[layer], f"ffn_{kind}.{e}.weight", f"ffn_{kind}_exps.weight"
        if per in lw:
            return lw[per]
        if fused not in lw:
            return None
        cache = self.__dict__.setdefault("_mtp_expert_w", {})
        key = (layer, kind, e)
        if key not in cache:
            w, (E, N, K) = lw[fused], self.w.records[f"blk.{layer}.{fused}"].shape
            if w.codec in _ROW_CODECS:
                parts = {name: t[e * N:(e + 1) * N] for name, t in w.parts.items()}
                cache[key] = quants.PackedWeight(w.codec, w.ggml_type, (N, K), parts)
            else:
                dense = quants.dequantize(w).view(E, N, K)[e].contiguous()
                cache[key] = quants.PackedWeight("f32", quants.T.F32, (N, K), {"weight": dense})
        return cache[key]
