"""Random but valid GGUF block payloads per ggml type, and the quant mixes llama-quantize would
pick per tensor role: what `mawforge synth` writes its quantized tensors with."""
from __future__ import annotations

import math
from typing import ClassVar

import numpy as np
from gguf import GGMLQuantizationType as Q

from mawforge.errors import UnsupportedError


# ---------------------------------------------------------------- block payloads

class Blocks:
    """Random but valid payloads of one ggml type with a chosen std and an optional
    per-column mean (constant over each 32-column group): encode -> uint8 [rows, row_bytes]."""
    formats: ClassVar[dict[Q, "Blocks"]] = {}
    qtype: ClassVar[Q]

    def __init_subclass__(cls, qtype: Q, **kw):
        super().__init_subclass__(**kw)
        cls.qtype = qtype
        Blocks.formats[qtype] = cls()

    def encode(self, rng: np.random.Generator, rows: int, cols: int, std: float,
               mean: np.ndarray | None = None) -> np.ndarray:
        raise NotImplementedError

    @staticmethod
    def f16(x: float, n: int) -> np.ndarray:
        return np.full((n, 1), x, np.float16).view(np.uint8)  # [n, 2]


def _bytes(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.integers(0, 256, size=shape, dtype=np.uint8)  # ~6x faster than Generator.bytes


def _group_means(mean: np.ndarray, rows: int, per_block: int) -> np.ndarray:
    return np.tile(mean.reshape(-1, 32)[:, 0].reshape(-1, per_block), (rows, 1))  # [blocks, per_block]


class _F32(Blocks, qtype=Q.F32):
    def encode(self, rng, rows, cols, std, mean=None):
        x = rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(std)
        return (x if mean is None else x + mean.astype(np.float32)).view(np.uint8)


class _F16(Blocks, qtype=Q.F16):
    def encode(self, rng, rows, cols, std, mean=None):
        return _F32.encode(self, rng, rows, cols, std, mean).view(np.float32).astype(np.float16).view(np.uint8)


class _Q8_0(Blocks, qtype=Q.Q8_0):  # f16 d, 32 x int8
    def encode(self, rng, rows, cols, std, mean=None):
        nb = rows * cols // 32
        q = _bytes(rng, nb, 32).view(np.int8)
        if mean is None:
            d = std / 73.9  # std of uniform int8
        else:  # narrower codes leave room to shift each block by its mean
            d = std / 36.95
            shift = np.clip(np.rint(_group_means(mean, rows, 1) / d), -63, 63).astype(np.int16)
            q = ((q.view(np.uint8) & 0x7F).astype(np.int16) - 64 + shift).astype(np.int8)
        return np.hstack([self.f16(d, nb), q.view(np.uint8)]).reshape(rows, -1)


class _Q4_0(Blocks, qtype=Q.Q4_0):  # f16 d, 16 bytes of nibbles; w = d * (q - 8)
    def encode(self, rng, rows, cols, std, mean=None):
        nb = rows * cols // 32
        qs = _bytes(rng, nb, 16)
        if mean is None:
            d = std / 4.61
        else:
            d = std / 2.29  # 3-bit codes around 8, shifted by the block mean
            shift = np.clip(np.rint(_group_means(mean, rows, 1) / d), -4, 4).astype(np.int16) + 8
            lo, hi = (qs & 7).astype(np.int16) - 4 + shift, ((qs >> 4) & 7).astype(np.int16) - 4 + shift
            qs = (np.clip(lo, 0, 15) | (np.clip(hi, 0, 15) << 4)).astype(np.uint8)
        return np.hstack([self.f16(d, nb), qs]).reshape(rows, -1)


class _Q4_K(Blocks, qtype=Q.Q4_K):
    """f16 d, f16 dmin, 12 bytes of 6-bit (scale, min) pairs, 128 bytes of nibbles.
    w = d*sc*q - dmin*m; with dmin = 7.5 d and m = sc every sub-block has mean 0, and
    m = sc - delta moves a sub-block's mean to 7.5 d delta for every row alike."""

    def encode(self, rng, rows, cols, std, mean=None):
        nb = rows * cols // 256
        sc = rng.integers(24, 41, size=(nb, 8), dtype=np.int16)
        d = std / (4.61 * 32)
        m = sc if mean is None else \
            np.clip(sc - np.rint(_group_means(mean, rows, 8) / (7.5 * d)).astype(np.int16), 0, 63)
        s = np.empty((nb, 12), np.uint8)
        s[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
        s[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
        s[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
        return np.hstack([self.f16(d, nb), self.f16(7.5 * d, nb), s, _bytes(rng, nb, 128)]).reshape(rows, -1)


class _Q6_K(Blocks, qtype=Q.Q6_K):  # 128 ql + 64 qh + 16 int8 scales + f16 d; w = d*sc*(q-32)
    def encode(self, rng, rows, cols, std, mean=None):
        if mean is not None:
            raise UnsupportedError("Q6_K payloads carry no mean")
        nb = rows * cols // 256
        sc = rng.integers(24, 41, size=(nb, 16), dtype=np.int8).view(np.uint8)
        return np.hstack([_bytes(rng, nb, 192), sc, self.f16(std / (18.47 * 32), nb)]).reshape(rows, -1)


class _Q2_K(Blocks, qtype=Q.Q2_K):
    """16 bytes of (4-bit scale | 4-bit min << 4), 64 bytes of 2-bit q, f16 d, f16 dmin:
    w = d*sc*q - dmin*m per 16 values. sc is even in 8..14 and dmin = 3 d, so m = sc/2 gives a
    sub-block mean of 0 and m = sc/2 - delta moves it by 3 d delta (the embeddings' mean)."""

    def encode(self, rng, rows, cols, std, mean=None):
        nb = rows * cols // 256
        sc = 2 * rng.integers(4, 8, size=(nb, 16), dtype=np.int16)
        d = std / (11.2 * 1.118)             # rms of sc times the std of q in 0..3
        m = sc // 2 if mean is None else np.clip(
            sc // 2 - np.rint(np.repeat(_group_means(mean, rows, 8), 2, axis=1) / (3 * d)).astype(np.int16), 0, 15)
        s = (sc | (m << 4)).astype(np.uint8)
        return np.hstack([s, _bytes(rng, nb, 64), self.f16(d, nb), self.f16(3 * d, nb)]).reshape(rows, -1)


class _Q3_K(Blocks, qtype=Q.Q3_K):
    """32 bytes of high bits, 64 of 2-bit low bits, 12 bytes of 6-bit scales (stored + 32), f16 d:
    random codes give q in -4..3 and scales in -32..31, so w = d*sc*q has std d * 18.5 * 2.29."""

    def encode(self, rng, rows, cols, std, mean=None):
        if mean is not None:
            raise UnsupportedError("Q3_K payloads carry no mean")
        nb = rows * cols // 256
        return np.hstack([_bytes(rng, nb, 108), self.f16(std / (18.5 * 2.29), nb)]).reshape(rows, -1)


# ---------------------------------------------------------------- quant mixes

class _MXFP4(Blocks, qtype=Q.MXFP4):  # E8M0 scale e, 16 bytes of FP4 (E2M1) nibbles; w = kvalue * 2^(e-128)
    KVALUE_RMS = math.sqrt(548 / 16)   # ggml's kvalues_mxfp4 (doubled E2M1: 0 1 2 3 4 6 8 12, signed), uniform codes

    def encode(self, rng, rows, cols, std, mean=None):
        nb = rows * cols // 32
        e = np.uint8(np.clip(round(128 + math.log2(std / self.KVALUE_RMS)), 1, 254))
        return np.hstack([np.full((nb, 1), e, np.uint8), _bytes(rng, nb, 16)]).reshape(rows, -1)


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's rule for the layers that get more bits in *_K_M mixes."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


class QuantMix:
    """ggml type per tensor role, as llama-quantize picks it for this mix."""
    mixes: ClassVar[dict[str, "QuantMix"]] = {}
    file_type: ClassVar[int]
    base: ClassVar[Q]

    def __init_subclass__(cls, name: str, file_type: int, base: Q, **kw):
        super().__init_subclass__(**kw)
        cls.file_type, cls.base = file_type, base
        QuantMix.mixes[name] = cls()

    def qtype(self, role: str, layer: int, n_layers: int) -> Q:
        return Q.Q6_K if role == "output" else self.base


class _Q4_K_M(QuantMix, name="Q4_K_M", file_type=15, base=Q.Q4_K):
    def qtype(self, role, layer, n_layers):
        if role == "output" or (role in ("attn_v", "ffn_down_exps") and use_more_bits(layer, n_layers)):
            return Q.Q6_K
        return Q.Q4_K


class _Q2_KMix(QuantMix, name="Q2_K", file_type=10, base=Q.Q2_K):
    """llama-quant.cpp's Q2_K rules for a model of n_gqa >= 4 and more than 8 experts: attn_v Q4_K,
    ffn_down (and its experts) and attn_output Q3_K, output Q6_K, the rest (token_embd too) Q2_K."""

    def qtype(self, role, layer, n_layers):
        return {"output": Q.Q6_K, "attn_v": Q.Q4_K, "ffn_down_exps": Q.Q3_K, "attn_output": Q.Q3_K}.get(role, Q.Q2_K)


class _Q8_0Mix(QuantMix, name="Q8_0", file_type=7, base=Q.Q8_0):
    def qtype(self, role, layer, n_layers):
        return Q.Q8_0  # llama.cpp keeps output at Q8_0 for this mix


class _Q4_0Mix(QuantMix, name="Q4_0", file_type=2, base=Q.Q4_0):
    pass


class _F16Mix(QuantMix, name="F16", file_type=1, base=Q.F16):
    def qtype(self, role, layer, n_layers):
        return Q.F16
