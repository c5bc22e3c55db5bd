"""The byte rules the planner and the runtime share, in one torch-free place: what a block
costs once it is in a slot (page rounding), and which common tensors are kept dense (float32
vectors and small per-head matrices that are not matmul weights). plan.py predicts with these,
the runtime allocates with them, so planned and allocated bytes cannot drift apart.
"""
from __future__ import annotations

from mawforge.archs import ARCHS

PAGE = 4096

# Shared by every architecture; each architecture file adds its own (Arch.dense).
_COMMON_DENSE = ("_norm.weight", ".bias", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "norm.weight")
DENSE_SUFFIXES = _COMMON_DENSE + tuple(s for a in ARCHS.values() for s in a.dense if s not in _COMMON_DENSE)


def round_page(n: int) -> int:
    return -(-n // PAGE) * PAGE


def is_dense(name: str) -> bool:
    """Common tensors held dequantized to float32 (the rest stay in their stored format)."""
    return name.endswith(DENSE_SUFFIXES)
