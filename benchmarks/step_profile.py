"""Where a one-token decode step's time goes: the shape-true pack, every expert block preloaded
(or, with --budget-gib, the plan's expert cache under that budget, as `mawforge run
--memory-budget-gib` loads it: embeddings streamed, no prompt cache), teacher-forced tokens,
MAWFORGE_BENCH_THREADS threads (2).

    python benchmarks/step_profile.py [--layers 24] [--tokens 32] [--context 0] [--budget-gib G]
                                      [--warmup 4] [--no-thread-governor]

Three passes after --warmup steps, over the same tokens resident and over tokens of their own
under a budget (a limited cache would hit on tokens it has just seen): plain (the step's wall
time, no instrumentation; with --context N the cache first holds N synthetic positions, the rows
fullsize.py's --fill-context writes; minor page faults a token, the engine thread's apart; under a
budget also the bytes read (demand reads, prefetches, prefetches evicted unused), the slots reshaped
to another size class, and the compute's wait on reads a token), with each native entry point
timed (a proxy around the ctypes library: the time inside C, and the GIL taken back after it),
and under cProfile, whose own-time per function is grouped into native kernels, torch ops, and
the Python of each package (cProfile's per-call cost inflates Python; read its groups as shares,
the plain median as the step).
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import fullsize_model, pack_of  # noqa: E402
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


RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", 1)   # Linux: the calling thread's own counts


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
    ap.add_argument("--budget-gib", type=float, default=None,
                    help="plan the expert cache under this budget instead of preloading every block")
    ap.add_argument("--warmup", type=int, default=4, help="steps before the timed passes")
    ap.add_argument("--no-thread-governor", action="store_true")
    ap.add_argument("--routing", choices=("zipf", "real"), default="zipf",
                    help="the file's routing: zipf (skew 1.0, stickiness 0.3) or real (synth --routing real)")
    a = ap.parse_args()
    import torch

    from mawforge.cache.core import read_bytes
    from mawforge.engine.runtime import Runtime, RuntimeOptions
    from mawforge.kernels import native
    from mawforge.plan import Budget
    torch.set_num_threads(THREADS)
    pack = pack_of(fullsize_model(a.layers, a.routing))
    context = max(512, a.context + 64 + a.warmup + 3 * a.tokens + 64)
    limited = a.budget_gib is not None
    cache = dict(budget=Budget.from_gib(a.budget_gib, "--budget-gib"), stream_embeddings=True,
                 prompt_cache_gib=0.0) if limited else dict(expert_cache_percent=100)
    rt = Runtime(pack, RuntimeOptions(context=context, prefill_chunk=64, threads=THREADS, check_digests=False,
                                      thread_governor=not a.no_thread_governor, **cache))
    if not limited:
        rt.cache.preload()
    if a.context:
        from fullsize import fill_cache
        fill_cache(rt.kv, a.context)
    rt.forward(tokens(64, 1))
    # a limited cache misses differently on tokens it has seen: each pass takes tokens of its own
    dec = tokens(a.warmup + 3 * a.tokens, 2)
    passes = [dec[a.warmup + i * a.tokens:a.warmup + (i + 1) * a.tokens] for i in range(3)] if limited \
        else [dec[a.warmup:a.warmup + a.tokens]] * 3

    def run(toks):
        out = []
        for t in toks:
            t0 = time.perf_counter()
            rt.forward([t], kind="decode")
            out.append(time.perf_counter() - t0)
        return out

    def where() -> dict:
        """What the cache did, the compute's wait on reads and the page faults taken, the engine
        thread's apart from the rest."""
        s = rt.cache.counters()
        return dict(read=read_bytes(s), wait=rt.cache.read_wait_seconds(),
                    demand=s["demand_loaded_bytes"], prefetch=s["prefetch_issued_bytes"],
                    wasted=s["prefetch_wasted_bytes"], reshaped=rt.cache.reshaped,
                    faults=resource.getrusage(resource.RUSAGE_SELF).ru_minflt,
                    engine_faults=resource.getrusage(RUSAGE_THREAD).ru_minflt)

    run(dec[:a.warmup])
    c0 = where()
    plain = run(passes[0])
    c1 = {k: (v - c0[k]) / len(passes[0]) for k, v in where().items()}
    lib = native.library()
    native._lib = proxy = TimedLibrary(lib)
    timed = run(passes[1])
    native._lib = lib
    prof = cProfile.Profile()
    prof.enable()
    run(passes[2])
    prof.disable()
    n = len(timed)
    print(f"step median {1e3 * statistics.median(plain):.2f} ms ({1 / statistics.median(plain):.2f} tok/s), "
          f"{a.layers} layers, {THREADS} threads, context {a.context} + 64 + {a.tokens}")
    if limited:
        p = rt.plan
        print(f"  budget {a.budget_gib} GiB: expert cache {p.E / 2**30:.2f} GiB ({p.cache_percent:.1f}%); plain pass "
              f"read {c1['read'] / 1e6:.0f} MB/token, waited on reads {1e3 * c1['wait']:.1f} "
              f"ms/token")
        print(f"  a token: demand reads {c1['demand'] / 1e6:.0f} MB, prefetches {c1['prefetch'] / 1e6:.0f} MB "
              f"({c1['wasted'] / 1e6:.1f} MB evicted unused), {c1['reshaped']:.1f} slots reshaped to another size "
              f"class; minor page faults {c1['faults']:.0f} ({c1['engine_faults']:.0f} on the engine thread, the "
              f"rest on readers and OpenMP workers)")
    else:
        print(f"  minor page faults a token: {c1['faults']:.0f} ({c1['engine_faults']:.0f} on the engine thread)")
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
