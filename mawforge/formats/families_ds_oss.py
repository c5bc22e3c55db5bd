"""Config readers for DeepSeek V2/V3 (llama.cpp arch `deepseek2`) and GPT-OSS (`gpt-oss`):
raw HF config.json or GGUF metadata -> ModelConfig field overrides, `extra` included. Torch-free.

extra keys (read by mawforge/models/deepseek2.py, gptoss.py, models/kv.py and plan.py):
  kv_layers      per layer what it keeps between steps: {"kind": "latent", "dim": r + d_rope}
                 (MLA: the compressed latent and the shared rope key, one row per position) or
                 {"kind": "kv", "kv_heads", "head_dim"[, "window"]}
  dense_layers   layers with a dense MLP (blk.N.ffn_gate/up/down) and no routed experts
  mla            q_lora_rank (0: plain attn_q), kv_lora_rank, qk_nope, qk_rope, v_head_dim
  router         gating (sigmoid|softmax), groups, groups_used, group_score (top2sum|max), scale
  rope_scaling   None or the YaRN parameters {factor, original_context, beta_fast, beta_slow,
                 attn_factor, mscale_all_dim, truncate}
  mtp_layers     DeepSeek-V3 MTP (nextn) layers after the model's (HF num_nextn_predict_layers,
                 GGUF nextn_predict_layers); drafting needs their tensors too (models/mtp.py)
  layer_types    GPT-OSS: "sliding" or "full" per layer; sliding_window; swiglu_limit, swiglu_alpha
"""
from __future__ import annotations

import math
from typing import Any

from mawforge.errors import FormatError

SWIGLU_ALPHA = 1.702   # fixed in transformers' GptOssExperts and llama.cpp's LLM_FFN_SWIGLU_OAI_MOE
SWIGLU_LIMIT = 7.0     # llama.cpp hard-codes it; HF configs carry swiglu_limit


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _hf_yarn(rope: dict, default_orig: int) -> dict | None:
    if rope.get("rope_type", "default") in ("default", None):
        return None
    if rope.get("rope_type") != "yarn":
        raise FormatError(f"rope type {rope.get('rope_type')!r} is not supported for this family (default or yarn)")
    factor = float(rope["factor"])
    attn = rope.get("attention_factor")
    m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
    if attn is None:
        attn = yarn_mscale(factor, m) / yarn_mscale(factor, m_all) if m and m_all else yarn_mscale(factor)
    return {"factor": factor, "original_context": int(rope.get("original_max_position_embeddings") or default_orig),
            "beta_fast": float(rope.get("beta_fast") or 32), "beta_slow": float(rope.get("beta_slow") or 1),
            "attn_factor": float(attn), "mscale_all_dim": float(m_all or 0.0),
            "truncate": bool(rope.get("truncate", True))}


def _gguf_yarn(m: dict, a: str, mscale_all_dim: float) -> dict | None:
    if m.get(a + "rope.scaling.type") != "yarn":
        return None
    factor = float(m[a + "rope.scaling.factor"])
    # llama.cpp: cos/sin scaled by 1 + 0.1 ln(factor) (times yarn_attn_factor); deepseek2 cancels
    # it when mscale == mscale_all_dim, as transformers does.
    attn = 1.0 if mscale_all_dim else yarn_mscale(factor)
    return {"factor": factor, "original_context": int(m[a + "rope.scaling.original_context_length"]),
            "beta_fast": float(m.get(a + "rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(m.get(a + "rope.scaling.yarn_beta_slow", 1.0)),
            "attn_factor": attn, "mscale_all_dim": mscale_all_dim, "truncate": True}   # ggml truncates


def _deepseek(n: int, heads: int, *, q_rank: int, kv_rank: int, nope: int, rope: int, v: int, dense: int,
              dense_ff: int, moe_ff: int, n_shared: int, router: dict, rope_scaling: dict | None,
              mtp: int) -> dict:
    if router["groups"] < 1 or router["groups_used"] > router["groups"]:
        raise FormatError(f"deepseek2: {router['groups_used']} of {router['groups']} expert groups")
    if rope % 2:
        raise FormatError(f"deepseek2: rope head dim {rope} is odd")
    return {"n_kv_heads": heads, "head_dim": nope + rope, "expert_ff": moe_ff, "shared_ff": moe_ff * n_shared,
            "rope_layout": "norm", "extra": {
                "kv_layers": [{"kind": "latent", "dim": kv_rank + rope}] * n,
                "dense_layers": list(range(min(dense, n))), "dense_ff": dense_ff,
                "mla": {"q_lora_rank": q_rank, "kv_lora_rank": kv_rank, "qk_nope": nope, "qk_rope": rope,
                        "v_head_dim": v},
                "router": router, "rope_scaling": rope_scaling, "mtp_layers": mtp}}


def deepseek2_hf(c: dict[str, Any]) -> dict:
    v3 = c.get("model_type") == "deepseek_v3"
    n_experts = int(c.get("n_routed_experts") or c.get("num_experts"))
    if int(c.get("moe_layer_freq") or 1) != 1:
        raise FormatError("deepseek2: moe_layer_freq other than 1 is not supported")
    groups, used = int(c.get("n_group") or 1), int(c.get("topk_group") or 1)
    if not v3 and c.get("topk_method", "greedy") == "greedy":
        groups = used = 1
    if n_experts % groups:
        raise FormatError(f"deepseek2: {n_experts} experts do not split into {groups} groups")
    router = {"gating": "sigmoid" if v3 else "softmax", "groups": groups, "groups_used": used,
              "group_score": "top2sum" if v3 else "max",
              "scale": float(c.get("routed_scaling_factor") or 1.0)}
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    return _deepseek(int(c["num_hidden_layers"]), int(c["num_attention_heads"]), q_rank=int(c.get("q_lora_rank") or 0),
                     kv_rank=int(c["kv_lora_rank"]), nope=int(c["qk_nope_head_dim"]), rope=int(c["qk_rope_head_dim"]),
                     v=int(c["v_head_dim"]), dense=int(c.get("first_k_dense_replace") or 0),
                     dense_ff=int(c["intermediate_size"]), moe_ff=int(c["moe_intermediate_size"]),
                     n_shared=int(c.get("n_shared_experts") or 0), router=router,
                     rope_scaling=_hf_yarn(rope, int(c.get("max_position_embeddings", 4096))),
                     mtp=int(c.get("num_nextn_predict_layers") or 0)) | {
        "norm_topk_prob": bool(c.get("norm_topk_prob", False)) if v3 else False}


def deepseek2_gguf(m: dict[str, Any]) -> dict:
    a = "deepseek2."
    rope = int(m[a + "rope.dimension_count"])
    # MLA files (convert_hf_to_gguf since 2025) carry the per-head widths in *_mla keys and the
    # compressed ones in key_length/value_length; older files carry per-head widths only.
    k_mla = m.get(a + "attention.key_length_mla")
    qk = int(k_mla if k_mla is not None else m[a + "attention.key_length"])
    v = int(m.get(a + "attention.value_length_mla") or m[a + "attention.value_length"])
    gating = {1: "softmax", 2: "sigmoid"}.get(int(m.get(a + "expert_gating_func", 1)))
    if gating is None:
        raise FormatError(f"deepseek2: expert_gating_func {m.get(a + 'expert_gating_func')} is not softmax or sigmoid")
    router = {"gating": gating, "groups": int(m.get(a + "expert_group_count", 1) or 1),
              "groups_used": int(m.get(a + "expert_group_used_count", 1) or 1),
              "group_score": "top2sum" if gating == "sigmoid" else "max",
              "scale": float(m.get(a + "expert_weights_scale", 1.0) or 1.0)}
    log_mul = float(m.get(a + "rope.scaling.yarn_log_multiplier", 0.0) or 0.0)
    mtp = int(m.get(a + "nextn_predict_layers", 0) or 0)     # counted in block_count, after the model's layers
    out = _deepseek(int(m[a + "block_count"]) - mtp, int(m[a + "attention.head_count"]),
                    q_rank=int(m.get(a + "attention.q_lora_rank", 0) or 0), kv_rank=int(m[a + "attention.kv_lora_rank"]),
                    nope=qk - rope, rope=rope, v=v, dense=int(m.get(a + "leading_dense_block_count", 0)),
                    dense_ff=int(m[a + "feed_forward_length"]), moe_ff=int(m[a + "expert_feed_forward_length"]),
                    n_shared=int(m.get(a + "expert_shared_count", 0)), router=router,
                    rope_scaling=_gguf_yarn(m, a, log_mul / 0.1), mtp=mtp)
    out["norm_topk_prob"] = bool(m.get(a + "expert_weights_norm", False))
    return out


def _gptoss(types: list[str], kv_heads: int, head_dim: int, window: int, limit: float,
            rope_scaling: dict | None) -> dict:
    kv = [{"kind": "kv", "kv_heads": kv_heads, "head_dim": head_dim, **({"window": window} if t == "sliding" else {})}
          for t in types]
    return {"norm_topk_prob": True, "extra": {
        "layer_types": types, "sliding_window": window, "swiglu_limit": limit, "swiglu_alpha": SWIGLU_ALPHA,
        "rope_scaling": rope_scaling, "kv_layers": kv}}


def gptoss_hf(c: dict[str, Any]) -> dict:
    n = int(c["num_hidden_layers"])
    types = c.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    if len(types) != n:
        raise FormatError(f"gpt-oss: {len(types)} layer types for {n} layers")
    hd = int(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    return _gptoss(["sliding" if t == "sliding_attention" else "full" for t in types],
                   int(c["num_key_value_heads"]), hd, int(c["sliding_window"]),
                   float(c.get("swiglu_limit", SWIGLU_LIMIT)),
                   _hf_yarn(rope, int(c.get("max_position_embeddings", 4096)))) | {"expert_ff": int(c["intermediate_size"])}


def gptoss_gguf(m: dict[str, Any]) -> dict:
    a = "gpt-oss."
    n = int(m[a + "block_count"])
    hd = int(m.get(a + "attention.key_length") or m[a + "embedding_length"] // m[a + "attention.head_count"])
    # llama.cpp: set_swa_pattern(2), i.e. even layers slide
    return _gptoss(["sliding" if i % 2 == 0 else "full" for i in range(n)], int(m[a + "attention.head_count_kv"]),
                   hd, int(m[a + "attention.sliding_window"]), SWIGLU_LIMIT, _gguf_yarn(m, a, 0.0))
