"""The byte rules the planner and the runtime share, in one torch-free place: what a block
costs once it is in a slot (page rounding), which common tensors are kept dense (float32
vectors and small per-head matrices that are not matmul weights), and which tensors each layer
keeps between steps (KV, latent or recurrent state). plan.py predicts with these, the runtime
allocates with them, so planned and allocated bytes cannot drift apart.
"""
from __future__ import annotations

from mawforge.archs import ARCHS
from mawforge.errors import UnsupportedError

PAGE = 4096

# The KV cache's dtypes: bytes per value of the float ones; q8_0 is ggml's block_q8_0 (per 32 values
# a float16 scale and 32 int8, 34 bytes), stored as uint8 rows of dim / 32 * 34 bytes
KV_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
KV_DTYPES = (*KV_ITEMSIZE, "q8_0")
Q8_0_BLOCK, Q8_0_BYTES = 32, 34


def kv_row_bytes(dim: int, kv_dtype: str) -> int:
    """Bytes of one cached row of `dim` values (a head's key or value, or an MLA latent row)."""
    if kv_dtype == "q8_0":
        if dim % Q8_0_BLOCK:
            raise UnsupportedError(f"a q8_0 KV cache needs rows of a multiple of {Q8_0_BLOCK} values; this model "
                                   f"caches rows of {dim}: use --kv-dtype float16")
        return dim // Q8_0_BLOCK * Q8_0_BYTES
    if kv_dtype not in KV_ITEMSIZE:
        raise UnsupportedError(f"unknown KV cache dtype {kv_dtype!r}; choose from {', '.join(KV_DTYPES)}")
    return dim * KV_ITEMSIZE[kv_dtype]

# Shared by every architecture; each architecture file adds its own (Arch.dense).
_COMMON_DENSE = ("_norm.weight", ".bias", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "norm.weight")
DENSE_SUFFIXES = _COMMON_DENSE + tuple(s for a in ARCHS.values() for s in a.dense if s not in _COMMON_DENSE)


def round_page(n: int) -> int:
    return -(-n // PAGE) * PAGE


def layer_state(spec: dict, context: int) -> list[tuple[tuple[int, ...], bool]]:
    """The tensors one layer keeps between steps, from its kv_layers entry: (shape, grows) per
    tensor; grows: in the KV cache's dtype and sized by the context, else fixed float32 state.
    kv: k and v [G, ctx, D]; latent (MLA): [ctx, dim]; recurrent: its state shapes; none: nothing."""
    kind = spec["kind"]
    if kind == "kv":
        return [((spec["kv_heads"], context, spec["head_dim"]), True)] * 2
    if kind == "latent":
        return [((context, spec["dim"]), True)]
    if kind == "none":
        return []
    return [(tuple(s), False) for s in spec["state"]]


def state_bytes(layout, context: int, kv_dtype: str, grows: bool) -> int:
    """Bytes of the growing (grows=True: rows of the KV cache's dtype) or the fixed float32 tensors
    of every layer in `layout`."""
    total = 0
    for spec in layout:
        for shape, g in layer_state(spec, context):
            if g == grows:
                n, dims = (kv_row_bytes(shape[-1], kv_dtype), shape[:-1]) if g else (4, shape)
                for d in dims:
                    n *= d
                total += n
    return total


def is_dense(name: str) -> bool:
    """Common tensors held dequantized to float32 (the rest stay in their stored format)."""
    return name.endswith(DENSE_SUFFIXES)


def prompt_entry_bytes(layout, tokens: int, kv_dtype: str, checkpoints: int, vocab: int) -> int:
    """One saved prompt of the prompt cache (engine/prompt_cache.py): the growing rows of its
    positions, the fixed float32 state at each of its checkpoints (recurrent layers only), and
    its last logits row (float32)."""
    rows = state_bytes(layout, tokens, kv_dtype, grows=True)
    return rows + checkpoints * state_bytes(layout, 0, kv_dtype, grows=False) + 4 * vocab
