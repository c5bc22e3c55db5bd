"""YaRN RoPE parameters from HF rope_scaling / GGUF rope.scaling.* (DeepSeek V2/V3, GPT-OSS).
Torch-free; the values land in Args.rope_scaling and models/base.py Rope applies them."""
from __future__ import annotations

import math

from mawforge.errors import FormatError


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
