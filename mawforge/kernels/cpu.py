"""Matmul on packed weights: `linear(x, w)` dispatches on the storage codec through a registry.

Precision: f32 weights compute in float32 (matches x @ W.T in float32); every other codec
computes with bf16 activations and weights (fp32 accumulation inside torch's kernels) and
returns x.dtype. Devices come from the tensors: torch's int4pack_for_cpu kernel is CPU-only,
so int4_g32 on another device (or a layout this CPU's kernel does not use) dequantizes tiles.

Legend: M = tokens, N = output features, K = input features, R = rows requested.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T

from mawforge.codecs import dequant, quants
from mawforge.codecs.quants import PackedWeight
from mawforge.kernels import native

# Elements of one dequantized tile (4 MiB as float32): smaller tiles lose more to per-op
# overhead than they win in cache locality (measured on Q5_K/Q6_K/Q8_0 768x2048).
TILE_ELEMENTS = 1 << 20
# From this many tokens, dequantizing int4 to a bf16 matrix and one bf16 GEMM beats the
# int4pack kernel, whose cost is linear in M: on a 768x2048 expert matrix (AVX512, 1
# thread) int4pack takes ~0.038 ms a token, dequantize + bf16 GEMM ~3.3 ms + 0.024 ms a
# token (crossover ~240); the two int8_g32 planes cost twice a token but dequantize
# slower too (crossover ~130). One threshold, on the safe side of both.
INT4PACK_MAX_M = 160
# Up to this many tokens a float32 GEMM on a float32 tile beats casting the tile to bf16.
GGML_FP32_MAX_M = 16


# Up to this many tokens (every prefill chunk in practice) the native integer kernels run, on
# every CPU. An isolated GEMM of one shape favours dequantized tiles and a bf16 GEMM above ~64
# tokens where the CPU has bf16 in hardware, but a prefill is not one shape: an expert's GEMM
# has as many rows as tokens routed to it, and oneDNN JIT-compiles and caches a primitive for
# each shape it meets (up to 1024 of them). Measured on an Intel Xeon with AMX (24-layer
# shape-true pack, 550-token prompt, chunk 512, 2 threads): native kernels throughout took
# 20.8-22.6 s resident against 27.6 s, and 26.7-29.6 s under a 4 GiB budget against 43.9-45.2 s,
# and the anonymous memory after the prompt was 0.26-0.29 GiB against 0.89 GiB (the primitive
# cache alone held 0.45 GiB), which had put peak RSS 0.5 GiB above the plan's F.
# Without hardware bf16 (AMD Zen 3, AVX2) the native kernels win at every size measured too:
# Q4_K/Q6_K 768x2048 and 2048x768 at M=512 took 18-26 ms native against 90-207 ms dequantized
# + bf16 and 14-247 ms dequantized + float32 (2 threads). One threshold on every CPU also keeps
# a prefill's numerics the same from one machine to the next.
NATIVE_MAX_M = 1 << 12


class LinearKernel:
    """`run(x [M, K], w) -> [M, N]`; subclasses register with `codecs=(...)`."""

    registry: dict[str, type[LinearKernel]] = {}

    def __init_subclass__(cls, codecs: tuple[str, ...], **kwargs):
        super().__init_subclass__(**kwargs)
        for name in codecs:
            LinearKernel.registry[name] = cls

    @staticmethod
    def run(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
        raise NotImplementedError


def _tiled(x: torch.Tensor, n: int, k: int, tile: callable) -> torch.Tensor:
    """x [M, K] @ W.T where tile(r0, r1) yields rows r0..r1 of W in x's dtype."""
    rows = max(16, TILE_ELEMENTS // k)
    if rows >= n:
        return F.linear(x, tile(0, n))
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)  # [M, N]
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        torch.matmul(x, tile(r0, r1).T, out=out[:, r0:r1])
    return out


class DenseF32(LinearKernel, codecs=("f32",)):
    @staticmethod
    def run(x, w):
        return F.linear(x.float(), w.parts["weight"]).to(x.dtype)


# the part of each codec whose bytes are GGUF rows the native kernels compute on
NATIVE_PARTS = {"ggml": "blocks", "f16": "weight", "bf16": "weight"}


def native_rows(w, m: int = 1) -> torch.Tensor | None:
    """The GGUF rows (uint8 [N, row bytes], a view) the native kernels compute this weight from,
    for m tokens on this device, or None where they cannot (another codec, device or type)."""
    part = NATIVE_PARTS.get(getattr(w, "codec", None))
    if part is None or m > NATIVE_MAX_M or w.device.type != "cpu" or not native.available(w.ggml_type):
        return None
    t = w.parts[part]
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def _native(x: torch.Tensor, w) -> torch.Tensor | None:
    rows = native_rows(w, x.shape[0])
    return None if rows is None else native.gemm(x, rows, w.ggml_type, *w.shape).to(x.dtype)


class DenseBF16(LinearKernel, codecs=("bf16",)):
    """The native kernels (x rounded to bf16, as llama.cpp's vec_dot type for BF16), else torch."""

    @staticmethod
    def run(x, w):
        y = _native(x, w)
        return y if y is not None else F.linear(x.to(torch.bfloat16), w.parts["weight"]).to(x.dtype)


class DenseF16(LinearKernel, codecs=("f16",)):
    """The native kernels where they build; else (CPU float16 GEMM is slow beyond a GEMV, and bf16
    would round the weights) widen tiles of W to float32 (exact) and compute in float32, on x
    rounded to float16 first, as llama.cpp does (float16 is the vec_dot type of F16 weights)."""

    @staticmethod
    def run(x, w):
        y = _native(x, w)
        if y is not None:
            return y
        weight = w.parts["weight"]
        xh = x.to(torch.float16).float()
        return _tiled(xh, w.shape[0], w.shape[1], lambda r0, r1: weight[r0:r1].float()).to(x.dtype)


class Int4G32(LinearKernel, codecs=("int4_g32_avx512", "int4_g32_avx2", "int4_g32_scalar")):
    @staticmethod
    def run(x, w):
        xb = x.to(torch.bfloat16).contiguous()
        native = w.device.type == "cpu" and w.codec == quants.native_int4_codec()
        if native and x.shape[0] < INT4PACK_MAX_M:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, w.parts["qweight"], 32, w.parts["scales_zeros"])
        else:
            y = F.linear(xb, quants.get_codec(w.codec).dequantize_as(w, torch.bfloat16))
        return y.to(x.dtype)


class Int8G32(LinearKernel, codecs=("int8_g32_avx512", "int8_g32_avx2", "int8_g32_scalar")):
    """Two int4pack GEMMs (hi and lo planes) summed in float32."""

    @staticmethod
    def run(x, w):
        xb = x.to(torch.bfloat16).contiguous()
        native = w.device.type == "cpu" and w.codec.replace("int8", "int4") == quants.native_int4_codec()
        if not native or x.shape[0] >= INT4PACK_MAX_M:
            return F.linear(xb, quants.get_codec(w.codec).dequantize_as(w, torch.bfloat16)).to(x.dtype)
        mm = torch.ops.aten._weight_int4pack_mm_for_cpu
        hi = mm(xb, w.parts["qweight_hi"], 32, w.parts["scales_zeros_hi"])
        lo = mm(xb, w.parts["qweight_lo"], 32, w.parts["scales_zeros_lo"])
        return (hi.float() + lo.float()).to(x.dtype)


class Ggml(LinearKernel, codecs=("ggml",)):
    """Byte-exact GGUF blocks. Up to NATIVE_MAX_M tokens on the CPU, every type in native.TYPES
    runs the native kernels (mawforge/kernels/native: x quantized to llama.cpp's vec_dot type,
    integer block dot products). Otherwise dequantize row tiles (bit-exact float32) and
    multiply: in float32 for few tokens, in bf16 for many."""

    @staticmethod
    def run(x, w):
        y = _native(x, w)
        if y is not None:
            return y
        blocks, (n, k) = w.parts["blocks"], w.shape
        dtype = torch.float32 if x.shape[0] <= GGML_FP32_MAX_M else torch.bfloat16
        tile = lambda r0, r1: dequant.dequantize_rows(blocks[r0:r1], w.ggml_type, k).to(dtype)
        return _tiled(x.to(dtype), n, k, tile).to(x.dtype)


def native_swiglu_types(parts: dict[str, PackedWeight], m: int) -> tuple[T, T, T] | None:
    """The (gate, up, down) GGUF types when `native.moe_ffn` can compute a SwiGLU expert with
    these parts (gate, up, down or gate_up, down) on m tokens here; None when it cannot."""
    if m > NATIVE_MAX_M or not native.available():
        return None
    down = parts.get("down")
    gates = [parts["gate_up"]] * 2 if "gate_up" in parts else [parts.get("gate"), parts.get("up")]
    ws = [*gates, down]
    if any(w is None or native_rows(w, m) is None for w in ws):
        return None
    return ws[0].ggml_type, ws[1].ggml_type, ws[2].ggml_type


def linear(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """x [M, K] @ W.T -> [M, N] in x.dtype, computed on the packed weight."""
    if x.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"linear needs x [M, {w.shape[1]}], got {tuple(x.shape)}")
    return LinearKernel.registry[w.codec].run(x, w)


def embedding_rows(raw_rows: torch.Tensor, ggml_type: T, k: int) -> torch.Tensor:
    """Raw bytes of R whole rows of a GGUF embedding (row r is bytes [r*rb, (r+1)*rb)) -> float32 [R, K]."""
    return dequant.dequantize_rows(raw_rows, T(ggml_type), k)
