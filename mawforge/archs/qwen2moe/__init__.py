"""Qwen2-MoE (HF `qwen2_moe`, GGUF `qwen2moe`): q/k/v biases, softmax router without top-k
renormalization, and a shared expert scaled by a sigmoid gate that runs beside the routed ones."""
from __future__ import annotations

from mawforge.archs.qwen3moe import ATTN
from mawforge.archs.spec import Arch

SHARED = ("ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight")


def required(cfg, layer: int) -> tuple:
    return ATTN + ("ffn_norm.weight", "ffn_gate_inp.weight") + (SHARED if cfg.shared_ff else ())


ARCH = Arch("qwen2moe", ("qwen2_moe",), f"{__name__}.model:Qwen2Moe",
            order=1, required=required,
            defaults=dict(qk_norm="none", norm_topk_prob=False, rope_layout="neox", qkv_bias=True))
