"""OLMoE (HF `olmoe`, GGUF `olmoe`): RMSNorm over the whole q and k projections (not per
head) before RoPE, softmax router without top-k renormalization."""
from __future__ import annotations

import torch

from mawforge.models.base import MoETransformer, rms_norm


class Olmoe(MoETransformer, arch="olmoe"):
    def qk_norm(self, layer: int, q: torch.Tensor, k: torch.Tensor):
        p, eps = f"blk.{layer}.", self.cfg.norm_eps
        return (rms_norm(q, self.w.dense(p + "attn_q_norm.weight"), eps),
                rms_norm(k, self.w.dense(p + "attn_k_norm.weight"), eps))
