"""Mixtral (HF `mixtral`, GGUF arch `llama` with experts): plain GQA attention, softmax over
the top-k router logits (the same as renormalized top-k of the full softmax). GGUF files carry
q/k rows permuted by convert_hf_to_gguf, so they use the interleaved ("norm") RoPE layout."""
from __future__ import annotations

from mawforge.archs.qwen3moe import ATTN
from mawforge.archs.spec import Arch


def read_gguf(meta: dict) -> dict:
    # convert_hf_to_gguf permutes q/k rows for arch `llama`
    return {"rope_layout": "norm"} if meta.get("general.architecture") == "llama" else {}


def required(cfg, layer: int) -> tuple:
    return ATTN + ("ffn_norm.weight", "ffn_gate_inp.weight")


ARCH = Arch("mixtral", ("mixtral",), f"{__name__}.model:Mixtral",
            order=2, read_gguf=read_gguf, gguf_aliases=("llama",),
            required=required, defaults=dict(qk_norm="none", norm_topk_prob=True, rope_layout="neox"))
