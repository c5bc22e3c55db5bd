"""GPT-OSS (HF `gpt_oss`, GGUF `gpt-oss`).

Attention: GQA with q/k/v/o biases, NEOX RoPE (YaRN in the released models), a learned sink
logit per head that joins each softmax and is dropped after it, and every other layer (the
even ones) limited to a sliding window. The KV cache keeps the whole context for every layer
(the window is a mask), so the planner's K counts full-length KV for the sliding layers too.
Router: logits with bias, top-k, softmax over the k chosen logits.
Experts: clamped SwiGLU: g = min(g, limit), u = clamp(u, -limit, limit),
out = (u + 1) * g * sigmoid(alpha * g), with biases after gate/up and after down.

Expert layouts (an expert block holds its weights and its biases):
  GGUF (convert_hf_to_gguf): ffn_gate_exps / ffn_up_exps [E, F, H] and ffn_down_exps [E, H, F],
      usually MXFP4 (packed byte-exact in the `ggml` codec, dequantized per row tile by the
      gguf reference dequantizer, then a float matmul), plus F32 biases [E, F] / [E, H].
  HF (bf16/f32 checkpoints): gate_up_proj [E, H, 2F] input-major with gate and up interleaved
      in the columns (gate = even, up = odd), down_proj [E, F, H] input-major, biases
      gate_up_proj_bias [E, 2F] (interleaved the same way) and down_proj_bias [E, H]. Stored
      as the kinds gate_up_t / down_t and computed as x @ W. HF MXFP4 checkpoints
      (*_blocks / *_scales) are refused by the reader: convert them to GGUF.

Legend: T tokens, C hidden, H q heads, G kv heads, D head dim, S cached positions, F expert ff.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mawforge.archs._yarn import _gguf_yarn, _hf_yarn
from mawforge.archs.spec import Arch, ArchArgs
from mawforge.errors import FormatError


@dataclass(frozen=True)
class Args(ArchArgs):
    sliding_window: int = 0
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    rope_scaling: dict | None = None


# ---- readers (torch-free): config.json / GGUF metadata -> ModelConfig field overrides ----
SWIGLU_ALPHA = 1.702   # fixed in transformers' GptOssExperts and llama.cpp's LLM_FFN_SWIGLU_OAI_MOE
SWIGLU_LIMIT = 7.0     # llama.cpp hard-codes it; HF configs carry swiglu_limit


def _gptoss(types: list[str], kv_heads: int, head_dim: int, window: int, limit: float,
            rope_scaling: dict | None) -> dict:
    kv = [{"kind": "kv", "kv_heads": kv_heads, "head_dim": head_dim, **({"window": window} if t == "sliding" else {})}
          for t in types]
    return {"norm_topk_prob": True, "extra": {
        "layer_types": types, "sliding_window": window, "swiglu_limit": limit, "swiglu_alpha": SWIGLU_ALPHA,
        "rope_scaling": rope_scaling, "kv_layers": kv}}


def read_hf(c: dict[str, Any]) -> dict:
    n = int(c["num_hidden_layers"])
    types = c.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    if len(types) != n:
        raise FormatError(f"gpt-oss: {len(types)} layer types for {n} layers")
    hd = int(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    return _gptoss(["sliding" if t == "sliding_attention" else "full" for t in types],
                   int(c["num_key_value_heads"]), hd, int(c["sliding_window"]),
                   float(c.get("swiglu_limit", SWIGLU_LIMIT)),
                   _hf_yarn(rope, int(c.get("max_position_embeddings", 4096)))) \
        | {"expert_ff": int(c["intermediate_size"])}


def read_gguf(m: dict[str, Any]) -> dict:
    a = "gpt-oss."
    n = int(m[a + "block_count"])
    hd = int(m.get(a + "attention.key_length") or m[a + "embedding_length"] // m[a + "attention.head_count"])
    # llama.cpp: set_swa_pattern(2), i.e. even layers slide
    return _gptoss(["sliding" if i % 2 == 0 else "full" for i in range(n)], int(m[a + "attention.head_count_kv"]),
                   hd, int(m[a + "attention.sliding_window"]), SWIGLU_LIMIT, _gguf_yarn(m, a, 0.0))


HF_NAMES = (
    (r"layers\.(\d+)\.post_attention_layernorm\.weight", "blk.{0}.post_attention_norm.weight"),
    (r"layers\.(\d+)\.self_attn\.o_proj\.bias", "blk.{0}.attn_output.bias"),
    (r"layers\.(\d+)\.self_attn\.sinks", "blk.{0}.attn_sinks.weight"),
    (r"layers\.(\d+)\.mlp\.router\.(weight|bias)", "blk.{0}.ffn_gate_inp.{1}"),
)

# Experts stored input-major (x @ W): gate_up_proj [E, H, 2F] with gate/up interleaved, down_proj [E, F, H]
HF_EXPERT_KINDS = {"gate_up": "gate_up_t", "down": "down_t"}
DENSE = ("attn_sinks.weight",)


def required(cfg, layer: int) -> tuple:
    return ("attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
            "post_attention_norm.weight", "attn_sinks.weight", "ffn_gate_inp.weight")


ARCH = Arch("gpt-oss", ("gpt_oss",), f"{__name__}.model:GptOss",
            order=7, args=Args, read_hf=read_hf, read_gguf=read_gguf,
            hf_names=HF_NAMES, hf_expert_kinds=HF_EXPERT_KINDS, dense=DENSE, required=required,
            defaults=dict(qk_norm="none", norm_topk_prob=True, rope_layout="neox", qkv_bias=True))
