"""The byte rules the planner and the runtime share, in one torch-free place: what a block
costs once it is in a slot (page rounding), and which common tensors are kept dense (float32
vectors and small per-head matrices that are not matmul weights). plan.py predicts with these,
the runtime allocates with them, so planned and allocated bytes cannot drift apart.
"""
from __future__ import annotations

PAGE = 4096

DENSE_SUFFIXES = ("_norm.weight", ".bias", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight",
                  # delta-net and Gemma 4 vectors
                  "_norm_1.weight", "_norm_2.weight", "norm.weight", ".scale", "ssm_a", "ssm_a_log",
                  "ssm_conv1d.weight", "layer_output_scale.weight", "rope_freqs.weight",
                  # gpt-oss sinks; DeepSeek MLA up-projections, used per head (absorbed)
                  "attn_sinks.weight", "attn_kv_b.weight", "attn_k_b.weight", "attn_v_b.weight")


def round_page(n: int) -> int:
    return -(-n // PAGE) * PAGE


def is_dense(name: str) -> bool:
    """Common tensors held dequantized to float32 (the rest stay in their stored format)."""
    return name.endswith(DENSE_SUFFIXES)
