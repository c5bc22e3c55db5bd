"""The int4pack layout: Q4_0/Q4_1/Q4_K (and Q8_0 as two int4 planes) transcoded to torch's CPU
int4pack weight plus bf16 scales_and_zeros, for machines where the native kernels cannot build.
The packed layout depends on the CPU kernel torch dispatches to (avx512: 64-row blocks, avx2 and
the scalar kernel: 32-row blocks; aten/src/ATen/native/cpu/int4mm_kernel.cpp), so the layout is
part of the codec name and recorded in the pack. Rounding bounds: quants.py's docstring."""
from __future__ import annotations

import functools

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from mawforge.codecs.quants import Codec, PackedWeight, PartSpec, _check_raw
from mawforge.codecs import dequant
from mawforge.errors import UnsupportedError


def int4_groups(raw: torch.Tensor, ggml_type: T, shape: tuple[int, int]):
    """Q4_0/Q4_1/Q4_K bytes -> (q uint8 [N, K] in 0..15, scale f32 [N, G], zero f32 [N, G])
    with gguf's value = (q - 8) * scale + zero, computed exactly in float32 before bf16."""
    n, k = shape
    elems, nbytes = dequant.block_geometry(ggml_type)
    blocks = raw.reshape(-1, nbytes)
    if ggml_type == T.Q4_K:
        d, dmin = dequant._f16(blocks[:, :2]), dequant._f16(blocks[:, 2:4])
        sc, mn = dequant.k_scale_min(blocks[:, 4:16])
        scale = d * sc.float()  # [B, 8]
        zero = 8 * scale - dmin * mn.float()
        q = dequant.q4_k_nibbles(blocks[:, 16:])
    else:
        off = 2 if ggml_type == T.Q4_0 else 4
        scale = dequant._f16(blocks[:, :2])  # [B, 1]
        zero = torch.zeros_like(scale) if ggml_type == T.Q4_0 else 8 * scale + dequant._f16(blocks[:, 2:4])
        q = dequant._nibbles(blocks[:, off:], dim=1)  # [B, 2, 16]
    return q.reshape(n, k), scale.reshape(n, k // 32), zero.reshape(n, k // 32)


class _Int4G32(Codec):
    """Packed weight uint8 [N, K/2] in torch's CPU layout + bf16 scales_and_zeros [G, N, 2].

    The CPU packing works on blocks of `block_n` rows: byte (k, j) of a full block holds row
    j (low nibble) and row j + block_n/2 (high nibble) at column k; a shorter tail block
    (16, 32 or 48 rows) pairs rows 2j and 2j+1. `pairs_full` marks a layout that pairs
    rows in full blocks too (the scalar kernel)."""
    layout: str
    block_n: int
    pairs_full: bool = False
    sources = (T.Q4_0, T.Q4_1, T.Q4_K)

    def supports(self, ggml_type):
        return ggml_type in self.sources

    def parts(self, ggml_type, shape):
        n, k = shape
        if n % 16 or k % 32:
            raise UnsupportedError(f"{self.name} needs rows divisible by 16 and row length by 32, got {n}x{k}")
        return [PartSpec("qweight", "uint8", (n, k // 2)), PartSpec("scales_zeros", "bfloat16", (k // 32, n, 2))]

    def _row_order(self, rows: int) -> np.ndarray:
        """Row of each nibble slot in a block of `rows`: slots [0, rows/2) low, the rest high."""
        if rows == self.block_n and not self.pairs_full:
            return np.arange(rows)
        return np.concatenate([np.arange(0, rows, 2), np.arange(1, rows, 2)])

    def _groups(self, n: int):
        """(first row, block count, rows per block, slot order): the full blocks, then the tail."""
        full = n // self.block_n
        if full:
            yield 0, full, self.block_n, self._row_order(self.block_n)
        if n % self.block_n:
            yield full * self.block_n, 1, n % self.block_n, self._row_order(n % self.block_n)

    def pack_nibbles(self, q: np.ndarray) -> np.ndarray:
        """uint8 [N, K] values 0..15 -> packed uint8 [N, K/2] in this layout."""
        n, k = q.shape
        out = []
        for start, count, rows, order in self._groups(n):
            blk = q[start:start + count * rows].reshape(count, rows, k)[:, order]
            slots = blk.transpose(0, 2, 1)  # [count, K, rows] nibble slots
            out.append((slots[..., : rows // 2] | (slots[..., rows // 2:] << 4)).reshape(-1))
        return np.concatenate(out).reshape(n, k // 2)

    def unpack_nibbles(self, packed: torch.Tensor) -> torch.Tensor:
        """Packed uint8 [N, K/2] -> uint8 [N, K] values 0..15 (torch, any device)."""
        n, k = packed.shape[0], packed.shape[1] * 2
        flat, q = packed.reshape(-1), []
        for start, count, rows, order in self._groups(n):
            blk = flat[start * k // 2:(start + count * rows) * k // 2].view(count, k, rows // 2)
            slots = torch.cat([blk & 0x0F, blk >> 4], dim=2)  # [count, K, rows]
            if not np.array_equal(order, np.arange(rows)):
                slots = slots.index_select(2, torch.from_numpy(np.argsort(order)).to(packed.device))
            q.append(slots.transpose(1, 2).reshape(count * rows, k))
        return torch.cat(q, dim=0) if len(q) > 1 else q[0]

    def encode(self, raw, ggml_type, shape):
        self.parts(ggml_type, shape)
        flat = torch.from_numpy(_check_raw(raw, ggml_type, shape).copy())
        q, scale, zero = int4_groups(flat, ggml_type, shape)
        sz = torch.stack([scale.T, zero.T], dim=-1).to(torch.bfloat16)  # [G, N, 2]
        return [self.pack_nibbles(q.numpy()), sz.contiguous().view(torch.uint16).numpy()]

    def dequantize(self, w):
        return self.dequantize_as(w, torch.float32)

    def dequantize_as(self, w: PackedWeight, dtype: torch.dtype) -> torch.Tensor:
        """[N, K] in `dtype`, computed in float32 as (q - 8) * scale + zero."""
        return self.plane(w.parts["qweight"], w.parts["scales_zeros"], w.shape).to(dtype)

    def plane(self, qweight: torch.Tensor, scales_zeros: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        n, k = shape
        q = self.unpack_nibbles(qweight).view(n, k // 32, 32)
        sz = scales_zeros.float()  # [G, N, 2]
        scale, zero = sz[..., 0].T.unsqueeze(-1), sz[..., 1].T.unsqueeze(-1)  # [N, G, 1]
        return ((q.float() - 8) * scale + zero).reshape(n, k)


class Int4G32Avx512(_Int4G32, name="int4_g32_avx512"):
    layout, block_n = "avx512", 64


class Int4G32Avx2(_Int4G32, name="int4_g32_avx2"):
    layout, block_n = "avx2", 32


class Int4G32Scalar(_Int4G32, name="int4_g32_scalar"):
    layout, block_n, pairs_full = "scalar", 32, True


class _Int8G32(Codec):
    """Q8_0 as two int4 planes on the same int4pack kernel: q = 16 * hi + lo with
    hi = q >> 4 in -8..7 (stored hi + 8, scale 16d, zero 0) and lo = q & 15 (scale d, zero 8d).
    The planes sum to bf16(d) * q exactly, so the only loss is d rounded to bf16:
    |w - w_gguf| <= 2**-8 * |w_gguf|. 10 bits a weight instead of 8.5, for two fused
    int4 GEMVs instead of a dequantization."""
    int4: str

    def supports(self, ggml_type):
        return ggml_type == T.Q8_0

    def parts(self, ggml_type, shape):
        half = Codec.registry[self.int4].parts(T.Q4_0, shape)
        return [PartSpec(p.name + sfx, p.dtype, p.shape) for sfx in ("_hi", "_lo") for p in half]

    def encode(self, raw, ggml_type, shape):
        self.parts(ggml_type, shape)
        n, k = shape
        blocks = torch.from_numpy(_check_raw(raw, ggml_type, shape).copy()).view(-1, 34)
        d = dequant._f16(blocks[:, :2]).reshape(n, k // 32)  # [N, G]
        q = blocks[:, 2:].view(torch.int8).reshape(n, k)
        int4 = Codec.registry[self.int4]
        out = []
        for nib, scale, zero in (((q >> 4) + 8, 16 * d, torch.zeros_like(d)), (q & 15, d, 8 * d)):
            sz = torch.stack([scale.T, zero.T], dim=-1).to(torch.bfloat16)  # [G, N, 2]
            out += [int4.pack_nibbles(nib.to(torch.uint8).numpy()), sz.contiguous().view(torch.uint16).numpy()]
        return out

    def planes(self, w: PackedWeight) -> list[torch.Tensor]:
        int4 = Codec.registry[self.int4]
        return [int4.plane(w.parts["qweight" + s], w.parts["scales_zeros" + s], w.shape) for s in ("_hi", "_lo")]

    def dequantize(self, w):
        hi, lo = self.planes(w)
        return hi + lo

    def dequantize_as(self, w: PackedWeight, dtype: torch.dtype) -> torch.Tensor:
        return self.dequantize(w).to(dtype)

    def magnitude(self, w: PackedWeight) -> torch.Tensor:
        hi, lo = self.planes(w)
        return hi.abs() + lo.abs()


class Int8G32Avx512(_Int8G32, name="int8_g32_avx512"):
    int4 = "int4_g32_avx512"


class Int8G32Avx2(_Int8G32, name="int8_g32_avx2"):
    int4 = "int4_g32_avx2"


class Int8G32Scalar(_Int8G32, name="int8_g32_scalar"):
    int4 = "int4_g32_scalar"


@functools.cache
def native_int4_codec() -> str | None:
    """The int4_g32 codec whose layout this process's torch CPU kernel uses, found by packing
    a probe (ATEN_CPU_CAPABILITY can change it); None if torch has no such kernel here."""
    probe = np.random.default_rng(0).integers(0, 16, (112, 64), dtype=np.uint8)
    try:
        got = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(probe).int(), 1)
    except (AttributeError, RuntimeError):
        return None
    for name, codec in Codec.registry.items():
        if isinstance(codec, _Int4G32) and np.array_equal(codec.pack_nibbles(probe), got.numpy().reshape(112, 32)):
            return name
    return None
