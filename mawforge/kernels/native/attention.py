"""The ctypes side of attention over the KV cache (decode_step.c attend_one and attend_rows): which
caches the native kernels take (float32/float16/bfloat16 rows, or q8_0 blocks in uint8 rows), their
dtype codes, and the calls a prefill chunk (models/base.attend) and a decode step make."""
from __future__ import annotations

import torch

from mawforge.byte_rules import Q8_0_BLOCK, Q8_0_BYTES
from mawforge.kernels.native import _sync_threads, available, library

# the KV cache dtypes attend_one and decode_layer read and write (decode_step.c's KV_* codes); uint8
# rows are q8_0 blocks (kernels/q8_0.py)
KV_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.uint8: 3}


def _kv_strides(t: torch.Tensor) -> int | None:
    """The group stride of a [G, S, D] view of a [G, ctx, D] cache (rows of D contiguous), else None."""
    if t.dim() != 3 or t.stride(2) != 1 or t.stride(1) != t.shape[2]:
        return None
    return t.stride(0)


def row_width(dtype: torch.dtype, d: int) -> int:
    """Elements of a cached row of d values: q8_0 rows (uint8) are d / 32 blocks of 34 bytes."""
    return d // Q8_0_BLOCK * Q8_0_BYTES if dtype == torch.uint8 else d


def _group_stride(t: torch.Tensor) -> int:
    """A cache view's group stride in values (decode_step.c's sg), from its stride in elements."""
    return t.stride(0) // Q8_0_BYTES * Q8_0_BLOCK if t.dtype == torch.uint8 else t.stride(0)


def attend_takes(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor) -> bool:
    """True where `attend_one` / `attend_rows` compute this attention: float32 q [T, H, D] on the
    CPU (T <= S), keys/vals [G, S, D] of one KV dtype (q8_0: uint8 [G, S, D / 32 * 34]) with rows
    contiguous and one group stride."""
    if not (available() and q.device.type == "cpu" and q.dtype == torch.float32 and q.dim() == 3
            and keys.dtype in KV_DTYPES and vals.dtype == keys.dtype and keys.device.type == "cpu"
            and vals.device.type == "cpu" and keys.shape == vals.shape and keys.dim() == 3
            and q.shape[1] % keys.shape[0] == 0 and (keys.dtype != torch.uint8 or q.shape[2] % Q8_0_BLOCK == 0)
            and row_width(keys.dtype, q.shape[2]) == keys.shape[2] and 0 < q.shape[0] <= keys.shape[1]):
        return False
    sg = _kv_strides(keys)
    return sg is not None and _kv_strides(vals) == sg


def kv_code(dtype: torch.dtype, rotated: bool = True) -> int:
    """decode_step.c's KV_* code of a cache dtype; uint8 (q8_0) rows are KV_Q8_0, of keys and values
    rotated as llama.cpp rotates them (kernels/q8_0.py), or KV_Q8_0_PLAIN with rotated=False."""
    return 4 if dtype == torch.uint8 and not rotated else KV_DTYPES[dtype]


def attend_one(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, scale: float,
               rotated: bool = True) -> torch.Tensor:
    """One token's GQA over keys/vals [G, S, D] (as attend_takes allows) -> [1, H*D] float32."""
    return attend_rows(q, keys, vals, scale, rotated)


def attend_rows(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, scale: float,
                rotated: bool = True) -> torch.Tensor:
    """Causal GQA of T query tokens q [T, H, D] at the last T of the S positions of keys/vals
    [G, S, D] (as attend_takes allows) -> [T, H*D] float32; each token's row is the bits
    attend_one gives at its position (decode_step.c attend_block). rotated: a q8_0 cache's rows
    are of rotated keys and values (kv_code)."""
    lib = library()
    _sync_threads(lib)
    t, h, d = q.shape
    g, s, _ = keys.shape
    qf = q.contiguous()
    out = torch.empty(t, h * d, dtype=torch.float32)
    code, sg = kv_code(keys.dtype, rotated), _group_stride(keys)
    if t == 1:
        rc = lib.attend_one(qf.data_ptr(), keys.data_ptr(), vals.data_ptr(), code, sg, s, h, g, d, scale,
                            out.data_ptr())
    else:
        rc = lib.attend_rows(qf.data_ptr(), keys.data_ptr(), vals.data_ptr(), code, sg, s, t, h, g, d, scale,
                             out.data_ptr())
    if rc != 0:
        raise MemoryError("native attention could not allocate its scratch")
    return out
