"""Native (C, OpenMP) kernels on GGUF blocks, computing as llama.cpp's CPU backend does:
activations quantized to q8_K (for Q4_K, Q5_K, Q6_K) or q8_0 (for Q8_0, Q4_0) and every block
dot product in integers (kquant_gemm.c explains the arithmetic).

* `gemm(x, raw, qtype, n, k)`: one weight matrix, x [M, K] -> [M, N] float32. One token
  (decode) runs the weight rows in pairs; more (prefill, verify) run cache-blocked: weight rows
  in L2-sized panels, each group of four tokens (in L1) against every row of a panel, so x is
  read from L1 instead of L2 for every row. The same bits either way, and at any thread count.
* `moe_ffn(x, experts, out)`: a layer's routed SwiGLU experts in one call (decode and small
  batches): gate/up rows of every expert, then down rows, in one OpenMP region, so a layer's
  experts cost one Python call instead of a dozen small torch ops per expert. More than one
  token goes through the same blocked loops as `gemm` (gate/up rows in blocks of 64 taken
  dynamically, an expert's tokens 64 at a time), with the one-token path's bits.
* `attn_qkv(...)` (decode_step.c): one token's q/k/v projections, q/k RMSNorm and RoPE in one
  call, through the same kernels as the separate calls (the same bits, fewer crossings).
* `attend_one(q, keys, vals, scale)`, `route_topk(x, w, k, renorm)`: one token's attention over
  the KV cache and its softmax top-k routing (decode_step.c); `attend_rows` a prefill chunk's
  causal attention, each token's row the bits attend_one gives at its position; `route_topk` of
  T rows routes each as it routes one token (route_topk_rows).
* `decode_layer(...)`: a decode step's layer up to the routed experts in one call (the norms,
  attention with its KV write, the residual, the router), composed of the calls above
  (models/fastpath.py binds its arguments).
* `reader()` (reader.c): a pool of native threads reading expert blocks with pread, whose
  reads never take the GIL (cache/store.py NativeReadPool).

The C sources are compiled on first use with the system's C compiler into a cache directory
($MAWFORGE_CACHE or ~/.cache/mawforge), keyed by the sources, the compiler flags, the compiler's
version and this CPU's feature flags (so a library built on one CPU is never loaded on another),
and loaded with ctypes (build.py). `-march=native` first (the AVX2 path where the CPU has it); if the
compiler rejects that, the portable `-march=x86-64` build (the same integer arithmetic in plain
C). Where -march=native has AVX-512 BW + VNNI, the four-token K-quant kernels use vpdpwssd on
512-bit registers (`vnni()`), with the AVX2 code's integer lanes, so the same bits. Every failed
attempt is reported once on stderr with the compiler's own message. Where no
compiler works, or MAWFORGE_NATIVE=0, `available()` is False, `why_unavailable()` says why, and
the callers keep the torch dequantize-and-multiply path.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import threading
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from mawforge.codecs.native_types import NATIVE_TYPE_NAMES
from mawforge.kernels.native.build import (BASE_FLAGS, HEADERS, MARCHES, SOURCES, _compile,  # noqa: F401
                                           _report, cpu_flags)

# every GGUF type the kernels compute on: the first five in kquant_gemm.c, the rest in quant_types.h
Q8_K_TYPES = (T.Q4_K, T.Q5_K, T.Q6_K, T.Q2_K, T.Q3_K, T.IQ4_XS, T.IQ3_XXS, T.IQ3_S, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S,
              T.IQ1_S, T.IQ1_M)
Q8_0_TYPES = (T.Q4_0, T.Q8_0, T.Q5_0, T.IQ4_NL, T.MXFP4)
Q8_1_TYPES = (T.Q4_1, T.Q5_1)
FLOAT_TYPES = (T.F16, T.BF16)
TYPES = (*Q8_0_TYPES, *Q8_1_TYPES, *Q8_K_TYPES, *FLOAT_TYPES)
assert {t.name for t in TYPES} == set(NATIVE_TYPE_NAMES), "codecs/native_types.py lists the kernels' types"
# elements one activation scale covers for each weight type: llama.cpp's "vec_dot_type" of it
# (q8_K 256, q8_0 / q8_1 32; F16 and BF16 round x to their own type, no scale: 32 is the step)
ACT_BLOCK = {**{t: 256 for t in Q8_K_TYPES}, **{t: 32 for t in (*Q8_0_TYPES, *Q8_1_TYPES, *FLOAT_TYPES)}}
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_why: str | None = None
_threads = None
_P = ctypes.c_void_p
_I = ctypes.c_int
_SIGNATURES = (("qgemm", [_I, _P, _I, _I, _P, _I, _P]),
               ("moe_ffn", [_P, _I, _I, _I, _I, _P, _P, _P, _I, _I, _I, _P, _P, _P, _P]),
               ("quantize_acts", [_I, _P, _I, _P, _P, _P]),
               ("set_pair_max", [ctypes.c_long]), ("supported", [_I]), ("simd_path", []), ("vnni_path", []),
               ("set_threads", [_I]),
               ("rms_norm_rows", [_P, _I, _I, _P, ctypes.c_float, _P]),
               ("rope_rows", [_P, _I, _I, _I, _P, _P, _I, _P]),
               ("attn_qkv", [_P, _I, _P, _I, _P, _I, _P, _I, _P, _P, _P, _I, _I, _I, _I, _P, _P, ctypes.c_float,
                             _P, _P, _I, _P, _P, _P]),
               ("kv_put", [_P, _P, _P, _P, _I, _I, _I, ctypes.c_long, _I]),
               ("attend_one", [_P, _P, _P, _I, ctypes.c_long, _I, _I, _I, _I, ctypes.c_float, _P]),
               ("attend_rows", [_P, _P, _P, _I, ctypes.c_long, _I, _I, _I, _I, _I, ctypes.c_float, _P]),
               ("route_topk", [_P, _I, _P, _I, _I, _I, _P, _P, _P]),
               ("route_topk_rows", [_P, _I, _I, _P, _I, _I, _I, _P, _P, _P]),
               ("decode_layer", [_P, _P, _P, _I, _P, _P, _P, _P, _P, _P]),
               ("decode_layer_rows", [_P, _I, _P, _P, _P, _P, _P, _P, _P, _P, _P]))
_VOID = ("set_threads", "rms_norm_rows", "rope_rows", "kv_put", "route_topk", "route_topk_rows")


def _build() -> ctypes.CDLL | None:
    global _why
    if os.environ.get("MAWFORGE_NATIVE", "1") == "0":
        _why = "turned off by MAWFORGE_NATIVE=0"
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        _why = "no C compiler found (set CC, or install gcc)"
        _report(f"{_why}; using the torch dequantize-and-multiply path")
        return None
    cache = Path(os.environ.get("MAWFORGE_CACHE", Path.home() / ".cache" / "mawforge"))
    for march in MARCHES:
        try:
            lib, err = _compile(cc, march, cache)
            if lib is not None:
                dll = ctypes.CDLL(str(lib))
                break
        except OSError as e:       # an unwritable cache, or a library the loader refuses
            lib, err = None, str(e)
        _report(f"build with -march={march} failed:\n{err}")
    else:
        _why = (f"compiling {', '.join(s.name for s in SOURCES)} failed with {cc} (-march={', '.join(MARCHES)}); "
                "see the messages above")
        _report(f"{_why}; using the torch dequantize-and-multiply path")
        return None
    for name, args in _SIGNATURES:
        f = getattr(dll, name)
        f.argtypes = args
        f.restype = None if name in _VOID else ctypes.c_long if name == "set_pair_max" else ctypes.c_int
    return dll


def library() -> ctypes.CDLL | None:
    global _lib, _tried
    if not _tried:
        with _lock:
            if not _tried:
                _lib, _tried = _build(), True
    return _lib


class Reader:
    """reader.c's entry points: `wait` through ctypes.CDLL (it blocks, so it lets the GIL go),
    the quick ones (`submit`, `done`, `free`) through a PyDLL of the same library, which keeps
    the GIL: letting it go for a microsecond's call would hand it to another thread."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        quick = ctypes.PyDLL(lib._name)
        L = ctypes.c_long
        for dll, name, args, res in ((lib, "rp_create", [_I], _P), (quick, "rp_submit", [_P, _I, L, L, _P, _I], _P),
                                     (quick, "rp_submit_segs", [_P, _I, ctypes.POINTER(L), _P, _I], _P),
                                     (quick, "rp_done", [_P], _I), (lib, "rp_wait", [_P, _P], L),
                                     (quick, "rp_free", [_P], None), (lib, "rp_destroy", [_P], None)):
            f = getattr(dll, name)
            f.argtypes, f.restype = args, res
            setattr(self, name[3:], f)


_reader: Reader | None = None


def reader() -> Reader | None:
    """The native read pool's functions, or None where the library is not loaded."""
    global _reader
    lib = library()
    if lib is None:
        return None
    if _reader is None:
        with _lock:
            if _reader is None:
                _reader = Reader(lib)
    return _reader


def why_unavailable() -> str | None:
    """None when the kernels are loaded, else the reason they are not (said once on stderr)."""
    library()
    return _why


def available(qtype: T | None = None) -> bool:
    return library() is not None and (qtype is None or qtype in TYPES)


def simd() -> bool:
    """True where the AVX2 path was compiled in (else the same integer arithmetic in plain C)."""
    lib = library()
    return bool(lib and lib.simd_path())


def vnni() -> bool:
    """True where the AVX-512 VNNI prefill kernels were compiled in (a CPU with AVX-512 BW + VNNI)."""
    lib = library()
    return bool(lib and lib.vnni_path())


_limit: int | None = None


def set_thread_limit(n: int | None) -> None:
    """Cap the kernels' own team at n threads (None: torch's count). Torch's thread count and
    its float results are not touched, and the kernels' results do not depend on the count
    (each thread computes whole output rows): a governor can change it between steps."""
    global _limit
    _limit = n


def _sync_threads(lib) -> None:
    global _threads
    nt = torch.get_num_threads() if _limit is None else max(1, min(_limit, torch.get_num_threads()))
    if nt != _threads:
        lib.set_threads(nt)
        _threads = nt


def set_pair_limit(nbytes: int) -> int:
    """One-token products (qgemm's rows, moe_ffn's gate with up and its down rows) run weight rows
    in pairs only in matrices of at most nbytes (kquant_gemm.c g_pair_max; default 0: one row at a
    time, as ggml, since decode weights stream from memory); returns the limit it replaces. The
    bits are the same either way; tests force each path with it."""
    return library().set_pair_max(int(nbytes))


def ptr(t: torch.Tensor | None) -> int | None:
    """A tensor's data pointer for a C argument, or None (NULL) for no tensor."""
    return None if t is None else t.data_ptr()


def gemm(x: torch.Tensor, raw: torch.Tensor, qtype: T, n: int, k: int) -> torch.Tensor:
    """x [M, K] (any float dtype, CPU) . W^T with W the GGUF rows in raw (uint8 [N, row bytes])."""
    lib = library()
    _sync_threads(lib)
    xf = x.float().contiguous()
    w = raw.contiguous()
    y = torch.empty(xf.shape[0], n, dtype=torch.float32)
    rc = lib.qgemm(int(qtype), xf.data_ptr(), xf.shape[0], k, w.data_ptr(), n, y.data_ptr())
    if rc != 0:
        raise ValueError(f"native gemm cannot run {T(qtype).name} with K={k}")
    return y


def quantize_acts(x: torch.Tensor, qtype: T) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The activation rounding the kernels apply before a dot with qtype rows: x [K] ->
    (q int8 [K], d float32 [K / block], sums of 16 int16 [K / 16]) (the sums for q8_K only; for
    q8_1 the bytes of the sums hold each block's s as float32 [K / 32]). For F16 / BF16 weights q
    is x rounded to that type, float32 [K], and d and bs are unused."""
    lib = library()
    xf = x.float().contiguous()
    k = xf.shape[0]
    q = torch.empty(k * (4 if qtype in FLOAT_TYPES else 1), dtype=torch.int8)
    d = torch.empty(k // ACT_BLOCK[qtype], dtype=torch.float32)
    bs = torch.zeros(k // 16, dtype=torch.int16)
    if lib.quantize_acts(int(qtype), xf.data_ptr(), k, q.data_ptr(), d.data_ptr(), bs.data_ptr()) != 0:
        raise ValueError(f"cannot quantize activations for {T(qtype).name} with K={k}")
    if qtype in FLOAT_TYPES:
        return q.view(torch.float32), d, bs
    return q, d, bs


class ExpertBatch:
    """Pointers to a layer group's expert blocks for one `moe_ffn` call: gate/up [F, C] and down
    [C, F] GGUF rows of one type each (gate and up may be the halves of a fused gate_up)."""

    def __init__(self, qtypes: tuple[T, T, T], f: int, c: int):
        self.qtypes, self.f, self.c = qtypes, f, c
        self.gate: list[int] = []
        self.up: list[int] = []
        self.down: list[int] = []

    def add(self, gate: int, up: int, down: int) -> None:
        self.gate.append(gate)
        self.up.append(up)
        self.down.append(down)


def pairs_from_weights(wts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """wts [E, M] (zero where token m does not use expert e) -> the (expert, token) pairs sorted
    by expert, as moe_ffn takes them: first [E + 1] int32, tok [P] int32, wt [P] float32."""
    ex, tok = np.nonzero(wts)
    first = np.searchsorted(ex, np.arange(wts.shape[0] + 1)).astype(np.int32)
    return first, tok.astype(np.int32), np.ascontiguousarray(wts[ex, tok], dtype=np.float32)


def moe_ffn(x: torch.Tensor, batch: ExpertBatch, wts: np.ndarray, out: torch.Tensor,
            pairs: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> None:
    """out [M, C] float32 += sum over experts e of wts[e, m] * SwiGLU_e(x[m]); wts [E, M] with
    zero where token m does not use expert e (or `pairs` as pairs_from_weights gives them).
    The blocks must stay alive during the call."""
    lib = library()
    _sync_threads(lib)
    xf = x.float().contiguous()
    e = len(batch.gate)
    first, tok, wt = pairs if pairs is not None else pairs_from_weights(wts)
    arr = ctypes.c_void_p * e
    tg, tu, td = (int(t) for t in batch.qtypes)
    rc = lib.moe_ffn(xf.data_ptr(), xf.shape[0], batch.c, batch.f, e, arr(*batch.gate), arr(*batch.up),
                     arr(*batch.down), tg, tu, td, first.ctypes.data, tok.ctypes.data, wt.ctypes.data,
                     out.data_ptr())
    if rc != 0:
        raise ValueError(f"native moe_ffn cannot run types {batch.qtypes} with C={batch.c}, F={batch.f}")


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of a float32 CPU x (any leading shape) with float32 w, as
    models/base.rms_norm computes it, in one call."""
    xf = x.contiguous()
    y = torch.empty_like(xf)
    n = xf.shape[-1]
    library().rms_norm_rows(xf.data_ptr(), xf.numel() // n, n, w.data_ptr(), eps, y.data_ptr())
    return y


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
    """Rotary embedding of float32 x [T, H, D] by cos/sin [T, D/2] (models/base.Rope's layouts)."""
    xf = x.contiguous()
    c, s = cos.contiguous(), sin.contiguous()
    y = torch.empty_like(xf)
    t, h, d = xf.shape
    library().rope_rows(xf.data_ptr(), t, h, d, c.data_ptr(), s.data_ptr(), int(neox), y.data_ptr())
    return y


def attn_qkv(x: torch.Tensor, ws: tuple, biases: tuple, heads: tuple[int, int, int], norm: tuple,
             cos: torch.Tensor, sin: torch.Tensor, neox: bool, out: torch.Tensor) -> None:
    """One token's attention inputs in one call: x [1, C] float32 contiguous; ws: (q, k, v) as
    (raw uint8 rows, GGML type); biases: float32 [N] or None each; heads (H, G, D); norm
    (kind 0 none / 1 per head / 2 whole projection, q weight, k weight, eps); cos/sin [D/2] of
    this position. Writes q [H*D], k [G*D], v [G*D] into out [(H+2G)*D] float32, in that order."""
    lib = library()
    _sync_threads(lib)
    h, g, d = heads
    kind, nq, nk, eps = norm
    (wq, tq), (wk, tk), (wv, tv) = ws
    o = out.data_ptr()
    rc = lib.attn_qkv(x.data_ptr(), x.shape[1], wq.data_ptr(), tq, wk.data_ptr(), tk, wv.data_ptr(), tv,
                      *map(ptr, biases), h, g, d, kind, ptr(nq), ptr(nk), eps, cos.data_ptr(), sin.data_ptr(),
                      int(neox), o, o + 4 * h * d, o + 4 * (h + g) * d)
    if rc != 0:
        raise ValueError(f"native attn_qkv cannot run types {(tq, tk, tv)} with C={x.shape[1]}")


def route_takes(x: torch.Tensor, w) -> bool:
    """True where `route_topk` computes this router: float32 tokens [T, C] and a float32 [E, C] weight."""
    return (available() and isinstance(w, torch.Tensor) and w.dtype == torch.float32 and w.dim() == 2
            and w.is_contiguous() and w.device.type == "cpu" and x.dim() == 2 and x.shape[0] >= 1
            and x.dtype == torch.float32 and x.device.type == "cpu" and x.shape[1] == w.shape[1])


def route_topk(x: torch.Tensor, w: torch.Tensor, k: int, renorm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing of T tokens: x [T, C], w [E, C] float32 -> idx int64 [T, k], weights
    [T, k]. Each row's result is the bits of that token routed alone (so a prompt row is routed
    as the decode step at its position routes it)."""
    lib = library()
    _sync_threads(lib)
    xf = x.contiguous()
    t = xf.shape[0]
    probs = torch.empty(t, w.shape[0], dtype=torch.float32)
    idx = torch.empty(t, k, dtype=torch.int64)
    wt = torch.empty(t, k, dtype=torch.float32)
    if t == 1:
        lib.route_topk(xf.data_ptr(), w.shape[1], w.data_ptr(), w.shape[0], k, int(renorm), probs.data_ptr(),
                       idx.data_ptr(), wt.data_ptr())
    else:
        lib.route_topk_rows(xf.data_ptr(), t, w.shape[1], w.data_ptr(), w.shape[0], k, int(renorm),
                            probs.data_ptr(), idx.data_ptr(), wt.data_ptr())
    return idx, wt


# the fused decode layer's wrappers (one token, or one token of each sequence of a batch)
from mawforge.kernels.native.layer import LayerArgs, ModelArgs, decode_layer, decode_layer_rows  # noqa: E402,F401
# attention over the KV cache (float and q8_0 rows)
from mawforge.kernels.native.attention import (KV_DTYPES, attend_one, attend_rows, attend_takes,  # noqa: E402,F401
                                               kv_code, row_width)
