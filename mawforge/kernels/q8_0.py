"""q8_0 KV cache rows in torch: ggml's block_q8_0 (per 32 values a float16 scale d, then 32 int8 q;
x = d * q), rows of D values stored as uint8 [..., D / 32 * 34].

`quantize` writes what ggml's x86 CPU `quantize_row_q8_0` writes (llama.cpp's KV cache bytes on these
CPUs with `--cache-type-k/v q8_0`): amax = max |x|, d = amax / 127 stored as float16, q = x * (127 /
amax) rounded to nearest even (0 where amax is 0), which is also decode_step.c's `q8_block_put`, so a
row the torch path writes (a prompt's chunks) and one the native decode step writes are the same
bytes. `dequantize` is ggml's dequantize_row_q8_0 (one float32 multiply a value)."""
from __future__ import annotations

import torch

from mawforge.byte_rules import Q8_0_BLOCK, Q8_0_BYTES


def quantize(x: torch.Tensor) -> torch.Tensor:
    """float rows [..., D] (D a multiple of 32) -> uint8 [..., D / 32 * 34]."""
    *lead, D = x.shape
    b = x.float().reshape(-1, D // Q8_0_BLOCK, Q8_0_BLOCK)
    amax = b.abs().amax(-1, keepdim=True)                                       # [N, nb, 1]
    inv = torch.where(amax != 0, 127.0 / amax, torch.zeros_like(amax))
    out = torch.empty(b.shape[0], b.shape[1], Q8_0_BYTES, dtype=torch.uint8, device=x.device)
    out[..., :2] = (amax / 127.0).to(torch.float16).view(torch.uint8)
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
