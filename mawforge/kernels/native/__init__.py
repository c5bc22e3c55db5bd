"""Native (C, OpenMP) fused kernels for the GGUF types torch has no fast path for: Q6_K, Q5_K.

The C source is compiled on first use with the system's C compiler into a cache directory
($MAWFORGE_CACHE or ~/.cache/mawforge), keyed by the source, the compiler flags and this CPU's
feature flags, and loaded with ctypes. Where no compiler is available, or MAWFORGE_NATIVE=0,
`available()` is False and the callers keep the torch dequantize-and-multiply path.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch
from gguf import GGMLQuantizationType as T

SOURCE = Path(__file__).with_name("kquant_gemm.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
FUNCS = {T.Q6_K: "q6k_gemm", T.Q5_K: "q5k_gemm"}
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_threads = None


def _cpu_flags() -> str:
    try:
        return next((l for l in open("/proc/cpuinfo") if l.startswith("flags")), "")
    except OSError:
        return ""


def _build() -> ctypes.CDLL | None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None or os.environ.get("MAWFORGE_NATIVE", "1") == "0":
        return None
    src = SOURCE.read_bytes()
    key = hashlib.sha256(src + " ".join(FLAGS).encode() + _cpu_flags().encode()).hexdigest()[:16]
    cache = Path(os.environ.get("MAWFORGE_CACHE", Path.home() / ".cache" / "mawforge"))
    lib = cache / f"kquant_gemm-{key}.so"
    if not lib.exists():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            out = Path(tmp) / lib.name
            r = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", str(out)], capture_output=True, text=True)
            if r.returncode != 0:
                return None
            os.replace(out, lib)       # atomic: a concurrent builder sees all or nothing
    dll = ctypes.CDLL(str(lib))
    for name in FUNCS.values():
        f = getattr(dll, name)
        f.restype = None
        f.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    dll.q6k_gemm.argtypes += [ctypes.c_void_p, ctypes.c_void_p]    # int8 and scale scratch for x
    dll.q6k_integer.restype = ctypes.c_int
    dll.set_threads.argtypes = [ctypes.c_int]
    return dll


def library() -> ctypes.CDLL | None:
    global _lib, _tried
    if not _tried:
        with _lock:
            if not _tried:
                _lib, _tried = _build(), True
    return _lib


def available(qtype: T | None = None) -> bool:
    return library() is not None and (qtype is None or qtype in FUNCS)


def gemm(x: torch.Tensor, raw: torch.Tensor, qtype: T, n: int, k: int) -> torch.Tensor:
    """x [M, K] (any float dtype, CPU) . W^T with W the GGUF rows in raw (uint8 [N, row bytes])."""
    global _threads
    lib = library()
    xf = x.float().contiguous()
    w = raw.contiguous()
    y = torch.empty(xf.shape[0], n, dtype=torch.float32)
    nt = torch.get_num_threads()
    if nt != _threads:
        lib.set_threads(nt)
        _threads = nt
    args = [xf.data_ptr(), xf.shape[0], k, w.data_ptr(), n, y.data_ptr()]
    if qtype == T.Q6_K:
        xq = torch.empty(xf.shape[0], k, dtype=torch.int8)
        dx = torch.empty(xf.shape[0], k // 256, dtype=torch.float32)
        args += [xq.data_ptr(), dx.data_ptr()]
    getattr(lib, FUNCS[qtype])(*args)
    return y


def q6k_quantizes_activations() -> bool:
    """True where the Q6_K kernel runs in integers on int8-quantized x (AVX2 builds), as
    llama.cpp does; the float path is exact up to float32 summation order."""
    lib = library()
    return bool(lib and lib.q6k_integer())
