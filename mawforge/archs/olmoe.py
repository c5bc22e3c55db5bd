"""OLMoE (HF `olmoe`, GGUF `olmoe`): RMSNorm over the whole q and k projections (not per
head) before RoPE, softmax router without top-k renormalization."""
from __future__ import annotations

from mawforge.archs.qwen3moe import required
from mawforge.archs.spec import Arch


def model() -> type:
    import torch

    from mawforge.models.base import MoETransformer, rms_norm

    class Olmoe(MoETransformer):
        def qk_norm(self, layer: int, q: torch.Tensor, k: torch.Tensor):
            p, eps = f"blk.{layer}.", self.cfg.norm_eps
            return (rms_norm(q, self.w.dense(p + "attn_q_norm.weight"), eps),
                    rms_norm(k, self.w.dense(p + "attn_k_norm.weight"), eps))

    return Olmoe


ARCH = Arch("olmoe", ("olmoe",), model, order=3, required=required,
            defaults=dict(qk_norm="full", norm_topk_prob=False, rope_layout="neox"))
