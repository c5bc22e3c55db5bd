"""OLMoE (HF `olmoe`, GGUF `olmoe`): RMSNorm over the whole q and k projections (not per
head) before RoPE, softmax router without top-k renormalization."""
from __future__ import annotations

from mawforge.archs.qwen3moe import required
from mawforge.archs.spec import Arch


def model() -> type:
    # the whole-projection q/k RMSNorm is the shared `qk_norm` hook's "full" kind (cfg.qk_norm)
    from mawforge.models.base import MoETransformer

    class Olmoe(MoETransformer):
        pass

    return Olmoe


ARCH = Arch("olmoe", ("olmoe",), model, order=3, required=required,
            defaults=dict(qk_norm="full", norm_topk_prob=False, rope_layout="neox"))
