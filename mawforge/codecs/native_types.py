"""The GGUF types the native kernels compute on (mawforge/kernels/native), torch-free, so `inspect`
and `plan` can name before loading the tensors that would run a dequantizing fallback instead
(dequantize a tile of float32 rows, then a float GEMM, every token)."""
from __future__ import annotations

# llama.cpp's vec_dot type of each: q8_K for the 256-element types, q8_0 / q8_1 for the 32-element
# ones, the weight's own type for F16 / BF16
NATIVE_TYPE_NAMES = ("Q4_0", "Q8_0", "Q5_0", "IQ4_NL", "MXFP4", "Q4_1", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "Q2_K",
                     "Q3_K", "IQ4_XS", "IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M", "F16",
                     "BF16")
# the codecs whose bytes the native kernels read as they are (kernels/cpu.py NATIVE_PARTS)
NATIVE_CODECS = ("ggml", "f16", "bf16")


def falls_back(qtype: str, codec: str) -> bool:
    """True where a weight of this GGUF type in this codec has no native kernel and is dequantized to
    float every time it is used (int4pack and f32 have kernels of their own in torch)."""
    return codec in NATIVE_CODECS and qtype not in NATIVE_TYPE_NAMES


def fallback_tensors(tensors) -> list[str]:
    """names of (name, qtype name, codec, ndim) entries that would fall back, matrices only"""
    return [name for name, qtype, codec, ndim in tensors if ndim >= 2 and falls_back(qtype, codec)]


def source_codec(qtype: str) -> str:
    """the codec the packer's default (exact) layout stores a source type in"""
    return {"F32": "f32", "F16": "f16", "BF16": "bf16"}.get(qtype, "ggml")
