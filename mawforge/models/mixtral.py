"""Mixtral (HF `mixtral`, GGUF arch `llama` with experts): plain GQA attention, softmax over
the top-k router logits (the same as renormalized top-k of the full softmax). GGUF files carry
q/k rows permuted by convert_hf_to_gguf, so they use the interleaved ("norm") RoPE layout."""
from __future__ import annotations

from mawforge.models.base import MoETransformer


class Mixtral(MoETransformer, arch="mixtral"):
    pass
