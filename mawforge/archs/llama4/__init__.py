"""Llama 4 MoE (HF `llama4_text` / `llama4`, text only; GGUF `llama4`), e.g. Scout 17B-16E and
Maverick 17B-128E.

Attention: GQA, no biases. RoPE layers rotate interleaved pairs (HF's complex view of q/k; GGUF
keeps HF's rows, llama.cpp's NORM rope) with llama3 frequency scaling (HF: from rope_parameters;
GGUF: the rope_freqs.weight divisors), then L2-normalize q and k per head (weightless RMS norm,
eps = rms_norm_eps) and attend within their chunk only: a query at position p sees keys at
positions p' <= p with p' // chunk == p // chunk. Every 4th layer is NoPE: no rotation, no qk
norm, full causal attention, and q scaled by the temperature 1 + attn_scale * log(1 + floor((p +
1) / floor_scale)). Softmax scale head_dim^-0.5.
FFN: dense SwiGLU layers (intermediate_size_mlp) interleave with MoE layers. An MoE layer runs a
shared SwiGLU expert on every token plus the top-k (k = 1 in the released models) routed experts
chosen by the router's raw logits; each chosen expert gets sigmoid(logit) * x as INPUT (not a
weight on its output: SwiGLU is not linear, so the two differ). The expert cache is asked with
that scaled input and weight 1, so route traces record 1.0 as the weight.
Experts: GGUF ffn_{gate,up,down}_exps (the plain SwiGLU the fused native kernel runs); HF fused
input-major gate_up_proj [E, H, 2F] (gate columns first) and down_proj [E, F, H], computed x @ W.

Legend: T tokens, C hidden, H q heads, G kv heads, D head dim, S cached positions, k experts per token.

extra keys (typed as Args below):
  moe_layers     layers with a router, routed experts and a shared expert
  dense_layers   the others: a dense SwiGLU MLP of width dense_ff (blk.N.ffn_gate/up/down)
  rope_layers    per layer: True where RoPE (and the L2 qk norm) applies; False on NoPE layers
  chunk          per layer: the attention chunk (a query sees only keys of its own chunk of
                 positions p // chunk) or None for full causal attention
  l2_qk_norm     L2 (weightless RMS) norm of q and k after RoPE, on RoPE layers
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

from dataclasses import dataclass
from typing import Any

from mawforge.archs.qwen3moe import ATTN
from mawforge.archs.spec import Arch, ArchArgs
from mawforge.errors import FormatError, UnsupportedError


@dataclass(frozen=True)
class Args(ArchArgs):
    moe_layers: tuple = ()          # the others are ArchArgs.dense_layers
    dense_ff: int = 0
    rope_layers: tuple = ()         # True: RoPE (+ L2 qk norm); False: NoPE
    chunk: tuple = ()               # attention chunk per layer, None = full causal
    l2_qk_norm: bool = True
    temperature: dict | None = None
    rope_scaling: dict | None = None
    experts_input_major: bool = False


# ---- readers (torch-free): config.json / GGUF metadata -> ModelConfig field overrides ----
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
                "l2_qk_norm": qk_norm, "temperature": temperature, "rope_scaling": rope_scaling,
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


def read_hf(c: dict[str, Any]) -> dict:
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
    if c.get("attention_bias") or c.get("hidden_act", "silu") != "silu":
        raise UnsupportedError("llama4 with attention biases or a non-SiLU activation is not supported "
                               "(the released models have neither)")
    return _llama4(n, moe, rope, [t == "chunked_attention" for t in types], None if chunk is None else int(chunk),
                   dense_ff=int(c.get("intermediate_size_mlp") or c["intermediate_size"]),
                   expert_ff=int(c["intermediate_size"]), qk_norm=bool(c.get("use_qk_norm", True)),
                   temperature=temp, rope_scaling=_hf_llama3(c.get("rope_parameters") or c.get("rope_scaling") or {}),
                   input_major=True)


def read_gguf(m: dict[str, Any]) -> dict:
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

    def at(key: str, layers: list[int]) -> int:     # a key llama.cpp reads per layer or once
        v = m[a + key]
        return int(v[layers[0]] if layers else 0) if isinstance(v, list) else int(v)

    moe = [i for i in range(n) if step > 0 and (i + 1) % step == 0]
    dense = [i for i in range(n) if i not in moe]
    n_experts = int(m[a + "expert_count"])
    return _llama4(n, moe, [(i + 1) % LLAMA_CPP_NOPE_EVERY != 0 for i in range(n)], chunked, LLAMA_CPP_CHUNK,
                   dense_ff=at("feed_forward_length", dense), expert_ff=at("expert_feed_forward_length", moe),
                   qk_norm=n_experts != 128, temperature=dict(LLAMA_CPP_TEMPERATURE), rope_scaling=None,
                   input_major=False)


HF_NAMES = (   # the dense MLP and the shared expert live under feed_forward., the router too
    (r"layers\.(\d+)\.feed_forward\.(gate|up|down)_proj\.weight", "blk.{0}.ffn_{1}.weight"),
    (r"layers\.(\d+)\.feed_forward\.shared_expert\.(gate|up|down)_proj\.weight", "blk.{0}.ffn_{1}_shexp.weight"),
    (r"layers\.(\d+)\.feed_forward\.router\.weight", "blk.{0}.ffn_gate_inp.weight"),
)
# HF experts: fused, input-major, gate columns first ([E, H, 2F], [E, F, H])
HF_EXPERT_KINDS = {"gate_up": "gate_up_t", "down": "down_t"}
DENSE = ("rope_freqs.weight",)
SHARED = ("ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight")


def required(cfg, layer: int) -> tuple:
    ffn = ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight") if layer in cfg.args.dense_layers \
        else ("ffn_gate_inp.weight",) + SHARED
    return ATTN + ("ffn_norm.weight",) + ffn


ARCH = Arch("llama4", ("llama4", "llama4_text"), f"{__name__}.model:Llama4",
            order=8, args=Args, read_hf=read_hf, read_gguf=read_gguf,
            hf_names=HF_NAMES, hf_expert_kinds=HF_EXPERT_KINDS, dense=DENSE, required=required,
            defaults={"qk_norm": "none", "norm_topk_prob": False, "rope_layout": "norm"})
