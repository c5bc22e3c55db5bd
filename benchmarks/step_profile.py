"""Where a resident one-token decode step's time goes: the shape-true pack, every expert block
preloaded, teacher-forced tokens, MAWFORGE_BENCH_THREADS threads (2).

    python benchmarks/step_profile.py [--layers 24] [--tokens 32] [--context 0] [--no-thread-governor]

Three passes over the same tokens after a warm-up: plain (the step's wall time, no
instrumentation; with --context N the cache first holds N synthetic positions, the rows
fullsize.py's --fill-context writes), with each native entry point timed (a proxy around the ctypes library: the
time inside C), and under cProfile, whose own-time per function is grouped into native kernels,
torch ops, and the Python of each package (cProfile's per-call cost inflates Python; read its
groups as shares, the plain median as the step).
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import pack_of, synth_model  # noqa: E402
from decode import THREADS, tokens  # noqa: E402


class TimedLibrary:
    """The native library with every call timed (seconds and calls per entry point)."""

    def __init__(self, lib):
        self.lib, self.seconds, self.calls = lib, {}, {}

    def __getattr__(self, name):
        f = getattr(self.lib, name)

        def timed(*args):
            t0 = time.perf_counter()
            r = f(*args)
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0
            self.calls[name] = self.calls.get(name, 0) + 1
            return r
        return timed


def group(path: str, name: str) -> str:
    if "native/__init__.py" in path and name in ("moe_ffn", "gemm", "attn_qkv", "rms_norm", "rope"):
        return "native kernels (C, via ctypes)"
    if path == "~" and ("torch" in name or "Tensor" in name):
        return "torch ops"
    for part in ("models", "cache", "engine", "kernels"):
        if f"mawforge/{part}/" in path:
            return f"Python: mawforge/{part}"
    return "Python: other (numpy, ctypes, builtins)"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--context", type=int, default=0, help="decode after this many synthetic cached positions")
    ap.add_argument("--no-thread-governor", action="store_true")
    a = ap.parse_args()
    import torch

    from mawforge.engine.runtime import Runtime, RuntimeOptions
    from mawforge.kernels import native
    torch.set_num_threads(THREADS)
    pack = pack_of(synth_model(a.layers, "Q4_K_M", skew=1.0, stickiness=0.3))
    context = max(512, a.context + 64 + a.tokens + 64)
    rt = Runtime(pack, RuntimeOptions(context=context, expert_cache_percent=100, prefill_chunk=64, threads=THREADS,
                                      check_digests=False, thread_governor=not a.no_thread_governor))
    rt.cache.preload()
    if a.context:
        from fullsize import fill_cache
        fill_cache(rt.kv, a.context)
    rt.forward(tokens(64, 1))
    dec = tokens(a.tokens + 4, 2)

    def run(toks):
        out = []
        for t in toks:
            t0 = time.perf_counter()
            rt.forward([t], kind="decode")
            out.append(time.perf_counter() - t0)
        return out

    run(dec[:4])
    plain = run(dec[4:])
    lib = native.library()
    native._lib = proxy = TimedLibrary(lib)
    timed = run(dec[4:])
    native._lib = lib
    prof = cProfile.Profile()
    prof.enable()
    run(dec[4:])
    prof.disable()
    n = len(timed)
    print(f"step median {1e3 * statistics.median(plain):.2f} ms ({1 / statistics.median(plain):.2f} tok/s), "
          f"{a.layers} layers, {THREADS} threads, context {a.context} + 64 + {a.tokens}")
    c_total = sum(proxy.seconds.values()) / n
    for k in sorted(proxy.seconds, key=lambda k: -proxy.seconds[k]):
        print(f"  C {k:16s} {1e3 * proxy.seconds[k] / n:7.2f} ms/token  {proxy.calls[k] / n:5.1f} calls/token")
    print(f"  C total {1e3 * c_total:.2f} ms; the rest {1e3 * (statistics.mean(timed) - c_total):.2f} ms/token "
          f"(Python and torch; step mean {1e3 * statistics.mean(timed):.2f} ms)")
    groups: dict[str, float] = {}
    stats = pstats.Stats(prof).stats
    for (path, _, name), (_, _, tottime, _, _) in stats.items():
        g = group(path, name)
        groups[g] = groups.get(g, 0.0) + tottime
    total = sum(groups.values())
    print("cProfile own time by group (shares of the profiled step):")
    for g in sorted(groups, key=lambda g: -groups[g]):
        print(f"  {g:40s} {1e3 * groups[g] / n:7.2f} ms/token  {100 * groups[g] / total:5.1f}%")
    top = sorted(((v[2], f"{os.path.basename(k[0])}:{k[2]}", v[1]) for k, v in stats.items()), reverse=True)[:25]
    print("top own time:")
    for tt, name, calls in top:
        print(f"  {1e3 * tt / n:7.3f} ms/token  {calls / n:6.1f} calls/token  {name}")
    rt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
