"""Vectorized torch dequantizers for GGUF block types, bit-exact with gguf.quants.dequantize.

Each dequantizer reads raw block bytes as a uint8 tensor on any device and repeats the
reference's float32 operations in the same order, so results match it bit for bit. Types
without a torch dequantizer go through gguf's numpy reference (correct, slower, via host).

Legend: B = blocks, S = sub-blocks of a block, E = elements of a sub-block, N = rows,
K = row length (elements), R = rows requested.
"""
from __future__ import annotations

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from mawforge.errors import FormatError

_DENSE = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}


def block_geometry(ggml_type: T) -> tuple[int, int]:
    """(elements per block, bytes per block) of a GGUF type."""
    return gguf.GGML_QUANT_SIZES[ggml_type]


def row_bytes(ggml_type: T, k: int) -> int:
    """Bytes of one row of k elements; k must be a whole number of blocks."""
    elems, nbytes = block_geometry(ggml_type)
    if k % elems:
        raise FormatError(f"row length {k} is not a multiple of the {ggml_type.name} block size {elems}")
    return k // elems * nbytes


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 (little-endian half) -> [..., 1] float32."""
    return b.contiguous().view(torch.float16).float()


# Bit unpacking works on int32 views of contiguous bytes: torch's uint8 shifts with a
# broadcast shift amount are not vectorized (~1 ns an element), int32 ops on 4 bytes are.
_M4, _M1 = 0x0F0F0F0F, 0x01010101


def _words(b: torch.Tensor) -> torch.Tensor:
    """[..., L] uint8 (L % 4 == 0) -> [..., L/4] int32 view of a contiguous copy."""
    return b.contiguous().view(torch.int32)


def _nibbles(b: torch.Tensor, dim: int) -> torch.Tensor:
    """[B, ..., L] uint8 -> low and high nibbles of every byte stacked at `dim` (uint8)."""
    w = _words(b)
    return torch.stack([w & _M4, (w >> 4) & _M4], dim=dim).view(torch.uint8)


def _bit_fields(b: torch.Tensor, shifts: range, mask: int, dim: int) -> torch.Tensor:
    """[B, ..., L] uint8 -> (byte >> s) & mask for each s, stacked at `dim` (uint8)."""
    w = _words(b)
    return torch.stack([(w >> s) & mask for s in shifts], dim=dim).view(torch.uint8)


def _bits32(qh: torch.Tensor) -> torch.Tensor:
    """[B, 4] uint8 little-endian uint32 -> [B, 32] uint8 bits (bit i = element i)."""
    bits = _bit_fields(qh, range(8), _M1, dim=1)  # [B, 8 (bit), 4 (byte)]
    return bits.transpose(1, 2).reshape(qh.shape[0], 32)


def k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the 12-byte 6-bit scales/mins of Q4_K/Q5_K: [B, 12] -> two [B, 8] uint8."""
    s = scales.reshape(-1, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


class BlockDequant:
    """One GGUF block type: `run(blocks [B, bytes]) -> float32 [B, elements]`."""

    registry: dict[T, type[BlockDequant]] = {}
    qtype: T

    def __init_subclass__(cls, qtype: T, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.qtype = qtype
        BlockDequant.registry[qtype] = cls

    @staticmethod
    def run(blocks: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class Q8_0(BlockDequant, qtype=T.Q8_0):
    @staticmethod
    def run(blocks):
        d = _f16(blocks[:, :2])  # [B, 1]
        return blocks[:, 2:].view(torch.int8).float() * d


class Q4_0(BlockDequant, qtype=T.Q4_0):
    @staticmethod
    def run(blocks):
        d = _f16(blocks[:, :2])
        q = _nibbles(blocks[:, 2:], dim=1)  # [B, 2, 16]: element j < 16 is the low nibble of byte j
        return d * (q.reshape(-1, 32).to(torch.int8) - 8).float()


class Q4_1(BlockDequant, qtype=T.Q4_1):
    @staticmethod
    def run(blocks):
        d, m = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
        q = _nibbles(blocks[:, 4:], dim=1)
        return d * q.reshape(-1, 32).float() + m


class Q5_0(BlockDequant, qtype=T.Q5_0):
    @staticmethod
    def run(blocks):
        d = _f16(blocks[:, :2])
        ql = _nibbles(blocks[:, 6:], dim=1).reshape(-1, 32)
        q = (ql | (_bits32(blocks[:, 2:6]) << 4)).to(torch.int8) - 16
        return d * q.float()


class Q5_1(BlockDequant, qtype=T.Q5_1):
    @staticmethod
    def run(blocks):
        d, m = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
        ql = _nibbles(blocks[:, 8:], dim=1).reshape(-1, 32)
        q = ql | (_bits32(blocks[:, 4:8]) << 4)
        return d * q.float() + m


def _k_scales(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: (d*sc, dmin*m), each float32 [B, 8, 1]."""
    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    sc, mn = k_scale_min(blocks[:, 4:16])
    return (d * sc.float()).unsqueeze(-1), (dmin * mn.float()).unsqueeze(-1)


def q4_k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[B, 128] uint8 -> [B, 8, 32] 4-bit values (sub-block 2i+h is nibble h of bytes 32i..32i+31)."""
    return _nibbles(qs.reshape(-1, 4, 32), dim=2).reshape(-1, 8, 32)


class Q4_K(BlockDequant, qtype=T.Q4_K):
    @staticmethod
    def run(blocks):
        d, dm = _k_scales(blocks)
        q = q4_k_nibbles(blocks[:, 16:]).float()  # [B, 8, 32]
        return (d * q - dm).reshape(-1, 256)


class Q5_K(BlockDequant, qtype=T.Q5_K):
    @staticmethod
    def run(blocks):
        d, dm = _k_scales(blocks)
        qh = _bit_fields(blocks[:, 16:48], range(8), _M1, dim=1)  # [B, 8, 32]: bit j of each byte
        q = (q4_k_nibbles(blocks[:, 48:]) | (qh << 4)).float()
        return (d * q - dm).reshape(-1, 256)


class Q6_K(BlockDequant, qtype=T.Q6_K):
    @staticmethod
    def run(blocks):
        ql = _nibbles(blocks[:, :128].reshape(-1, 2, 64), dim=2)  # [B, 2, 2, 64]
        qh = _bit_fields(blocks[:, 128:192].reshape(-1, 2, 32), range(0, 8, 2), 0x03030303, dim=2)  # [B, 2, 4, 32]
        q = (ql.reshape(-1, 8, 32) | (qh.reshape(-1, 8, 32) << 4)).view(torch.int8) - 32
        scales = blocks[:, 192:208].view(torch.int8).float()  # [B, 16]
        d = _f16(blocks[:, 208:210]) * scales
        return (d.unsqueeze(-1) * q.reshape(-1, 16, 16).float()).reshape(-1, 256)


def has_torch_dequant(ggml_type: T) -> bool:
    return ggml_type in BlockDequant.registry or ggml_type in _DENSE


def dequantize_rows(raw: torch.Tensor, ggml_type: T, k: int) -> torch.Tensor:
    """Raw bytes of whole rows (uint8, any shape whose size is rows * row_bytes) -> float32 [R, K]."""
    flat = raw.reshape(-1)
    rb = row_bytes(ggml_type, k)
    if flat.dtype != torch.uint8 or flat.numel() % rb:
        raise FormatError(f"{ggml_type.name} rows of {k} elements need a uint8 buffer of a multiple of {rb} bytes")
    rows = flat.numel() // rb
    if ggml_type in _DENSE:
        return flat.view(_DENSE[ggml_type]).float().reshape(rows, k)
    kind = BlockDequant.registry.get(ggml_type)
    if kind is None:
        return _reference(flat, ggml_type).reshape(rows, k).to(flat.device)
    _, nbytes = block_geometry(ggml_type)
    return kind.run(flat.reshape(-1, nbytes)).reshape(rows, k)


def _reference(flat: torch.Tensor, ggml_type: T) -> torch.Tensor:
    try:
        values = gguf.quants.dequantize(flat.cpu().numpy(), ggml_type)
    except NotImplementedError:
        raise FormatError(f"gguf cannot dequantize {ggml_type.name}") from None
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
