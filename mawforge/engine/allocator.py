"""Keep freed memory from piling up in the C allocator, so peak RSS stays within the plan's F.

glibc malloc serves a request above its mmap threshold with a fresh mapping and unmaps it on
free, but it raises that threshold to the size of every mapped block freed (up to 32 MiB on
64-bit), after which the activations of a prefill chunk (scores, q/k/v, the experts' inputs:
0.1-30 MiB each) come from its arenas and stay there when freed, in pieces too scattered to
trim. Measured (scripts/rss_phases.py, 24-layer shape-true pack, 4 GiB budget, 550-token prompt
three times, chunk 512): the arenas' free bytes grew 0.03 -> 0.20 -> 0.26 -> 0.29 GiB (peak RSS
4.11 GiB against F = 4.00), while the bytes in use stayed at 0.145 GiB. With the thresholds fixed
at 128 KiB the free bytes stayed at 0.005 GiB and peak RSS at 3.88 GiB, at the same CPU time.

So the runtime fixes both thresholds once, at load (M_MMAP_THRESHOLD also turns the dynamic
adjustment off). Where the C library is not glibc (no `mallopt`), nothing changes.
"""
from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
THRESHOLD_BYTES = 128 << 10
_done: bool | None = None


def bound_allocator() -> bool:
    """Fix glibc's mmap and trim thresholds (once per process). True when they are fixed."""
    global _done
    if _done is None:
        _done = False
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            mallopt = libc.mallopt
        except (OSError, AttributeError):
            return False
        mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        _done = bool(mallopt(M_MMAP_THRESHOLD, THRESHOLD_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, THRESHOLD_BYTES))
    return _done
