"""Config readers for Llama 4 MoE (HF `llama4_text` / `llama4`, GGUF `llama4`): raw HF
config.json or GGUF metadata -> ModelConfig field overrides, `extra` included. Torch-free.

extra keys (read by mawforge/models/llama4.py):
  moe_layers     layers with a router, routed experts and a shared expert
  dense_layers   the others: a dense SwiGLU MLP of width dense_ff (blk.N.ffn_gate/up/down)
  rope_layers    per layer: True where RoPE (and the L2 qk norm) applies; False on NoPE layers
  chunk          per layer: the attention chunk (a query sees only keys of its own chunk of
                 positions p // chunk) or None for full causal attention
  qk_norm        L2 (weightless RMS) norm of q and k after RoPE, on RoPE layers
  temperature    None, or {floor_scale, attn_scale}: NoPE layers scale q by
                 1 + attn_scale * log(1 + floor((p + 1) / floor_scale))
  rope_scaling   None, or llama3's {factor, low_freq_factor, high_freq_factor, original_context}
                 (GGUF carries the resulting per-pair divisors as rope_freqs.weight instead)
  experts_input_major  HF keeps experts fused and input-major (gate_up_proj [E, H, 2F], gate
                 columns first; down_proj [E, F, H]); packed as the kinds gate_up_t / down_t

llama.cpp (llama-model's llama4) reads none of chunk, NoPE interval, floor_scale or attn_scale
from the file: it fixes them at 8192, 4, 8192 and 0.1, and drops the qk norm for 128 experts
(Maverick). The GGUF reader does the same, so a GGUF runs as llama.cpp runs it.
"""
from __future__ import annotations

from typing import Any

from mawforge.errors import FormatError, UnsupportedError

LLAMA_CPP_CHUNK = 8192
LLAMA_CPP_NOPE_EVERY = 4
LLAMA_CPP_TEMPERATURE = {"floor_scale": 8192, "attn_scale": 0.1}


def _llama4(n: int, moe: list[int], rope: list[bool], chunked: list[bool], chunk: int | None, *, dense_ff: int,
            expert_ff: int, qk_norm: bool, temperature: dict | None, rope_scaling: dict | None,
            input_major: bool) -> dict:
    if len(rope) != n or len(chunked) != n:
        raise FormatError(f"llama4: {len(rope)} rope flags and {len(chunked)} layer types for {n} layers")
    if any(not 0 <= i < n for i in moe):
        raise FormatError(f"llama4: MoE layers {moe} outside 0..{n - 1}")
    if chunk is not None and chunk < 1:
        raise FormatError(f"llama4: attention chunk size must be positive, got {chunk}")
    if temperature is not None and (temperature["floor_scale"] <= 0 or temperature["attn_scale"] < 0):
        raise FormatError(f"llama4: bad attention temperature {temperature}")
    moe = sorted(set(moe))
    return {"shared_ff": expert_ff, "expert_ff": expert_ff, "qk_norm": "none", "rope_layout": "norm",
            "norm_topk_prob": False, "extra": {
                "moe_layers": moe, "dense_layers": [i for i in range(n) if i not in moe], "dense_ff": dense_ff,
                "rope_layers": rope, "chunk": [chunk if c and chunk else None for c in chunked],
                "qk_norm": qk_norm, "temperature": temperature, "rope_scaling": rope_scaling,
                "experts_input_major": input_major}}


def _hf_llama3(rope: dict) -> dict | None:
    kind = rope.get("rope_type", "default")
    if kind in ("default", None):
        return None
    if kind != "llama3":
        raise UnsupportedError(f"llama4: rope type {kind!r} is not supported (default or llama3)")
    return {"factor": float(rope["factor"]), "low_freq_factor": float(rope["low_freq_factor"]),
            "high_freq_factor": float(rope["high_freq_factor"]),
            "original_context": int(rope["original_max_position_embeddings"])}


def llama4_hf(c: dict[str, Any]) -> dict:
    """transformers' Llama4TextConfig.__post_init__ derivations, when the lists are absent."""
    n = int(c["num_hidden_layers"])
    step = int(c.get("interleave_moe_layer_step", 1))
    moe = c.get("moe_layers")
    moe = [int(i) for i in moe] if moe is not None else list(range(step - 1, n, step))
    every = int(c.get("no_rope_layer_interval", 4))
    rope = [bool(x) for x in (c.get("no_rope_layers") or [int((i + 1) % every != 0) for i in range(n)])][:n]
    chunk = c.get("attention_chunk_size")
    types = c.get("layer_types") or ["chunked_attention" if r and chunk is not None else "full_attention"
                                     for r in rope]
    temp = ({"floor_scale": int(c.get("floor_scale", 8192)), "attn_scale": float(c.get("attn_scale", 0.1))}
            if c.get("attn_temperature_tuning", True) else None)
    if c.get("attention_bias"):
        raise UnsupportedError("llama4 with attention biases is not supported (the released models have none)")
    return _llama4(n, moe, rope, [t == "chunked_attention" for t in types], None if chunk is None else int(chunk),
                   dense_ff=int(c.get("intermediate_size_mlp") or c["intermediate_size"]),
                   expert_ff=int(c["intermediate_size"]), qk_norm=bool(c.get("use_qk_norm", True)),
                   temperature=temp, rope_scaling=_hf_llama3(c.get("rope_parameters") or c.get("rope_scaling") or {}),
                   input_major=True)


def llama4_gguf(m: dict[str, Any]) -> dict:
    """As llama-model's llama4 load_arch_hparams (see the module docstring)."""
    a = "llama4."
    n = int(m[a + "block_count"])
    if m.get(a + "attention.sliding_window") == 0:
        raise UnsupportedError("llama4 GGUF with sliding_window 0 (all layers full attention, e.g. MobileLLM) "
                               "is not supported")
    if a + "rope.freq_base_swa" in m and float(m[a + "rope.freq_base_swa"]) != float(m.get(a + "rope.freq_base", 0)):
        raise UnsupportedError("llama4 GGUF with a separate RoPE base for chunked layers is not supported")
    step = int(m.get(a + "interleave_moe_layer_step", 1))
    pattern = m.get(a + "attention.sliding_window_pattern", LLAMA_CPP_NOPE_EVERY)
    chunked = ([bool(x) for x in pattern] if isinstance(pattern, list) else
               [int(pattern) == 0 or i % int(pattern) < int(pattern) - 1 for i in range(n)])
    ff = m[a + "feed_forward_length"]
    efff = m[a + "expert_feed_forward_length"]
    moe = [i for i in range(n) if step > 0 and (i + 1) % step == 0]
    dense = [i for i in range(n) if i not in moe]
    n_experts = int(m[a + "expert_count"])
    return _llama4(n, moe, [(i + 1) % LLAMA_CPP_NOPE_EVERY != 0 for i in range(n)], chunked, LLAMA_CPP_CHUNK,
                   dense_ff=int(ff[dense[0]] if isinstance(ff, list) and dense else (ff if not isinstance(ff, list) else 0)),
                   expert_ff=int(efff[moe[0]] if isinstance(efff, list) else efff), qk_norm=n_experts != 128,
                   temperature=dict(LLAMA_CPP_TEMPERATURE), rope_scaling=None, input_major=False)
