"""q8_0 KV cache rows in torch: ggml's block_q8_0 (per 32 values a float16 scale d, then 32 int8 q;
x = d * q), rows of D values stored as uint8 [..., D / 32 * 34].

`quantize` writes what ggml's x86 CPU `quantize_row_q8_0` writes (llama.cpp's KV cache bytes on these
CPUs with `--cache-type-k/v q8_0`): amax = max |x|, d = amax / 127 stored as float16, q = x * (127 /
amax) rounded to nearest even (0 where amax is 0), which is also decode_step.c's `q8_block_put`, so a
row the torch path writes (a prompt's chunks) and one the native decode step writes are the same
bytes. `dequantize` is ggml's dequantize_row_q8_0 (one float32 multiply a value).

The rows of an attention layer's cache are of rotated keys and values, as llama.cpp rotates them
with a quantized cache (llama-kv-cache.cpp attn_rot_k/v, where the head dim is a multiple of 64):
keys and queries by the Walsh-Hadamard matrix H_nk (nk the largest power of two >= 64 dividing the
head dim), values by H_64, the attention's output by H_64 again (H is symmetric, H H = I). Scores
and outputs are unchanged; an outlier's weight spreads over its block before the 8-bit rounding
(on the trained demo model half the KL divergence from the float16 cache's logits). `rot_k`,
`rot_v` are decode_step.c's rotate_rows with the same float operations, so both paths write the
same bytes."""
from __future__ import annotations

import math

import numpy as np
import torch

from mawforge.byte_rules import Q8_0_BLOCK, Q8_0_BYTES


def quantize(x: torch.Tensor) -> torch.Tensor:
    """float rows [..., D] (D a multiple of 32) -> uint8 [..., D / 32 * 34]."""
    *lead, D = x.shape
    b = x.float().reshape(-1, D // Q8_0_BLOCK, Q8_0_BLOCK)
    amax = b.abs().amax(-1, keepdim=True)                                       # [N, nb, 1]
    # tensor / tensor: one correctly rounded division, as the C code's (a python scalar over a tensor
    # is reciprocal() times it in torch, an ulp off at times, which moves a product off a .5 tie)
    c127 = torch.tensor(127.0, dtype=torch.float32, device=x.device)
    inv = torch.where(amax != 0, c127 / amax, torch.zeros_like(amax))
    out = torch.empty(b.shape[0], b.shape[1], Q8_0_BYTES, dtype=torch.uint8, device=x.device)
    out[..., :2] = (amax / c127).to(torch.float16).view(torch.uint8)
    out[..., 2:] = torch.round(b * inv).to(torch.int8).view(torch.uint8)
    return out.reshape(*lead, D // Q8_0_BLOCK * Q8_0_BYTES)


def dequantize(rows: torch.Tensor) -> torch.Tensor:
    """uint8 [..., D / 32 * 34] -> float32 [..., D]."""
    *lead, R = rows.shape
    b = rows.reshape(-1, R // Q8_0_BYTES, Q8_0_BYTES)
    d = b[..., :2].contiguous().view(torch.float16).float()                   # [N, nb, 1]
    q = b[..., 2:].contiguous().view(torch.int8).float()                      # [N, nb, 32]
    return (d * q).reshape(*lead, R // Q8_0_BYTES * Q8_0_BLOCK)


def round_trip(x: torch.Tensor) -> torch.Tensor:
    """x through q8_0 and back, float32 (a query row as ggml's flash attention converts Q to K's q8_0)."""
    return dequantize(quantize(x))


def rows_float(t: torch.Tensor) -> torch.Tensor:
    """Cached rows as float32 values: a q8_0 cache's (uint8) dequantized, a float cache's converted."""
    return dequantize(t) if t.dtype == torch.uint8 else t.float()


def rot_k_block(d: int) -> int:
    """The keys' (and queries') rotation block for head dim d: 0 (none) unless d % 64 == 0."""
    if d % 64:
        return 0
    n = 64
    while d % (2 * n) == 0:
        n *= 2
    return n


def hadamard(x: torch.Tensor, n: int) -> torch.Tensor:
    """x [..., D] float32 -> each block of n values times H_n (n a power of two dividing D):
    butterflies (a + b, a - b) at strides 1, 2, 4, ..., then times float32(1/sqrt(n)), as
    decode_step.c's fwht."""
    *lead, D = x.shape
    y = x.float().reshape(-1, D // n, n)
    h = 1
    while h < n:
        y = y.reshape(-1, D // n, n // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2)
        h *= 2
    return y.reshape(*lead, D) * torch.tensor(np.float32(1.0 / math.sqrt(n)))


def rot_k(x: torch.Tensor) -> torch.Tensor:
    """Keys or queries [..., D] in the cache's rotated basis (unchanged where D % 64)."""
    n = rot_k_block(x.shape[-1])
    return hadamard(x, n) if n else x


def rot_v(x: torch.Tensor) -> torch.Tensor:
    """Values [..., D] into the cache's basis, or an attention output back out of it (H_64 both ways)."""
    return hadamard(x, 64) if x.shape[-1] % 64 == 0 else x


def query(q: torch.Tensor, rotated: bool) -> torch.Tensor:
    """Query rows [..., D] as the attention over a q8_0 cache scores them: rotated as the cached keys
    (rotated: KVCache.rotated), then through q8_0 (K's vec-dot type in ggml's flash attention)."""
    return round_trip(rot_k(q) if rotated else q)


def output(o: torch.Tensor, rotated: bool) -> torch.Tensor:
    """An attention output [..., D] over a q8_0 cache back from the values' rotated basis."""
    return rot_v(o) if rotated else o
