"""OLMoE (HF `olmoe`, GGUF `olmoe`): RMSNorm over the whole q and k projections (not per
head) before RoPE, softmax router without top-k renormalization."""
from __future__ import annotations

from mawforge.archs.qwen3moe import required
from mawforge.archs.spec import Arch


ARCH = Arch("olmoe", ("olmoe",), f"{__name__}.model:Olmoe",
            order=3, required=required,
            defaults=dict(qk_norm="full", norm_topk_prob=False, rope_layout="neox"))
