"""Config readers for GLM-4.5/4.6 MoE (HF `glm4_moe`, llama.cpp arch `glm4moe`): raw HF
config.json or GGUF metadata -> ModelConfig field overrides, `extra` included. Torch-free.

extra keys (read by mawforge/models/glm4moe.py):
  dense_layers   the first first_k_dense_replace layers: dense SwiGLU (ffn_gate/up/down), no experts
  router         sigmoid scores; groups, groups_used (group-limited choice), scale (routed_scaling_factor)
  rope_dim       dims of each head that RoPE rotates (head_dim * partial_rotary_factor)
  mtp_layers     MTP (nextn) layers after the model's (HF num_nextn_predict_layers, GGUF nextn_predict_layers)
q/k RMSNorm is optional (GLM-4.5 has it, the Air not): the model uses it where the tensors are.
"""
from __future__ import annotations

from typing import Any

from mawforge.errors import FormatError, UnsupportedError


def _extra(n_layers: int, dense: int, *, groups: int, groups_used: int, scale: float, rope_dim: int, mtp: int) -> dict:
    if not 0 <= dense <= n_layers or groups < 1 or not 1 <= groups_used <= groups:
        raise FormatError(f"glm4moe: {dense} dense layers of {n_layers}, {groups_used} of {groups} expert groups")
    return {"extra": {"dense_layers": list(range(dense)), "rope_dim": rope_dim, "mtp_layers": mtp,
                      "router": {"groups": groups, "groups_used": groups_used, "scale": scale}}}


def glm4moe_hf(c: dict[str, Any]) -> dict:
    hd = int(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])
    rope = c.get("rope_parameters") or {}
    prf = float(rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 0.5)))
    if rope.get("rope_type", "default") != "default":
        raise FormatError(f"glm4moe: rope type {rope.get('rope_type')!r} is not supported (default only)")
    moe_ff = int(c["moe_intermediate_size"])
    return _extra(int(c["num_hidden_layers"]), int(c.get("first_k_dense_replace", 1)),
                  groups=int(c.get("n_group") or 1), groups_used=int(c.get("topk_group") or 1),
                  scale=float(c.get("routed_scaling_factor", 1.0)), rope_dim=int(hd * prf),
                  mtp=int(c.get("num_nextn_predict_layers", 0) or 0)) | {
        "shared_ff": moe_ff * int(c.get("n_shared_experts", 1) or 0),
        "qkv_bias": bool(c.get("attention_bias", False)), "norm_topk_prob": bool(c.get("norm_topk_prob", True))}


def glm4moe_gguf(m: dict[str, Any]) -> dict:
    a = "glm4moe."
    if int(m.get(a + "expert_gating_func", 2)) != 2:
        raise FormatError(f"glm4moe: expert_gating_func {m.get(a + 'expert_gating_func')} is not sigmoid (2)")
    if any(m.get(a + "rope.dimension_sections") or ()):
        raise UnsupportedError("glm4moe with M-RoPE sections (a GLM-4.5V conversion) is not supported; "
                               "the text models have none")
    mtp = int(m.get(a + "nextn_predict_layers", 0) or 0)
    hd = int(m.get(a + "attention.key_length") or m[a + "embedding_length"] // m[a + "attention.head_count"])
    return _extra(int(m[a + "block_count"]) - mtp, int(m.get(a + "leading_dense_block_count", 0) or 0),
                  groups=max(1, int(m.get(a + "expert_group_count", 1) or 1)),
                  groups_used=max(1, int(m.get(a + "expert_group_used_count", 1) or 1)),
                  scale=float(m.get(a + "expert_weights_scale", 1.0) or 1.0),
                  rope_dim=int(m.get(a + "rope.dimension_count") or hd // 2), mtp=mtp) | {
        "shared_ff": int(m[a + "expert_feed_forward_length"]) * int(m.get(a + "expert_shared_count", 0) or 0)}
