"""Qwen3-MoE (HF `qwen3_moe`, GGUF `qwen3moe`): per-head RMSNorm on q and k before RoPE,
softmax router with renormalized top-k, no shared expert.

The template for a new architecture: copy this package (the facts here, the model class in
model.py), rename, and override only the hooks that differ (see mawforge/models/base.py
MoETransformer and CONTRIBUTING.md).
"""
from __future__ import annotations

from mawforge.archs.spec import Arch

ATTN = ("attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight")


def required(cfg, layer: int) -> tuple:
    """The blk.N. tensors the model reads; `pack` refuses a source missing one, naming it."""
    return ATTN + ("ffn_norm.weight", "ffn_gate_inp.weight", "attn_q_norm.weight", "attn_k_norm.weight")


ARCH = Arch("qwen3moe", ("qwen3_moe",), f"{__name__}.model:Qwen3Moe",
            order=0, required=required,
            defaults=dict(qk_norm="head", norm_topk_prob=True, rope_layout="neox"))
