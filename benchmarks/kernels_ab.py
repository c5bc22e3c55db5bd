"""Old against new native GEMM kernels in one process: the kernel sources at a git revision
(--base, default HEAD~1) and the working tree's, each compiled with the flags
kernels/native uses and loaded side by side with ctypes, timed alternating on the same x and W
(qgemm, and moe_ffn on one expert-sized SwiGLU), median of --repeats. Prints ms and GMAC/s.
Run on purpose, never from the tests:

    .venv/bin/python benchmarks/kernels_ab.py --base a95bcf8~1 --threads 2 [--tokens 64,512]

--clock cpu times the process's CPU seconds instead of wall seconds: on a machine that other work
shares, with --threads 1, GMAC per CPU second (OpenMP's spinning inflates it at more threads).
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mawforge.fixtures.kquants import quantize  # noqa: E402
from mawforge.kernels import native  # noqa: E402

SRC = "mawforge/kernels/native"


def build(tree: Path, out: Path) -> ctypes.CDLL:
    srcs = [str(tree / SRC / n) for n in ("kquant_gemm.c", "decode_step.c")]
    subprocess.run(["cc", *native.BASE_FLAGS, "-march=native", *srcs, "-o", str(out), "-lm"], check=True)
    lib = ctypes.CDLL(str(out))
    for name, args in native._SIGNATURES[:2] + (("set_threads", [ctypes.c_int]),):
        getattr(lib, name).argtypes = args
    return lib


def base_tree(rev: str, tmp: Path) -> Path:
    (tmp / SRC).mkdir(parents=True, exist_ok=True)
    for n in ("kquant_gemm.c", "decode_step.c", "quant_types.h", "iq_tables.h"):   # the headers where rev has them
        r = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{SRC}/{n}"], capture_output=True)
        if r.returncode != 0 and n.endswith(".c"):
            raise SystemExit(f"{rev} has no {SRC}/{n}: {r.stderr.decode()[-300:]}")
        if r.returncode == 0:
            (tmp / SRC / n).write_bytes(r.stdout)
    return tmp


def rows(qt: T, n: int, k: int) -> np.ndarray:
    w = (np.random.default_rng(n).standard_normal((n, k)) * 0.1).astype(np.float32)
    return np.ascontiguousarray(quantize(w, qt))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="HEAD~1")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", default="64,512")
    ap.add_argument("--shapes", default="768x2048,2048x4096", help="N x K of Q4_K matrices")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    args = ap.parse_args()
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        libs = {"old": build(base_tree(args.base, t / "base"), t / "old.so"), "new": build(ROOT, t / "new.so")}
        for lib in libs.values():
            lib.set_threads(args.threads)
        print(f"base {args.base}, threads {args.threads}, {args.clock} clock, "
              f"median of {args.repeats} alternating runs")
        print(f"{'op':10} {'N x K':>10} {'M':>4} {'old ms':>8} {'new ms':>8} {'old GMAC/s':>10} "
              f"{'new GMAC/s':>10} {'x':>5}")
        for shape in [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]:
            n, k = shape
            w = rows(T.Q4_K, n, k)
            for m in (int(v) for v in args.tokens.split(",")):
                x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
                ys = {name: np.empty((m, n), np.float32) for name in libs}
                times = {name: [] for name in libs}
                for _ in range(args.repeats + 1):
                    for name, lib in libs.items():
                        t0 = clock()
                        lib.qgemm(int(T.Q4_K), x.ctypes.data, m, k, w.ctypes.data, n, ys[name].ctypes.data)
                        times[name].append(clock() - t0)
                assert np.array_equal(ys["old"], ys["new"])
                report("qgemm", f"{n}x{k}", m, {a: statistics.median(v[1:]) for a, v in times.items()}, m * n * k)
        # one expert-sized SwiGLU (768 x 2048 gate/up Q4_K, down Q6_K) over every token
        f, c = 768, 2048
        g, u, d = rows(T.Q4_K, f, c), rows(T.Q4_K, f + 1, c)[:f], rows(T.Q6_K, c, f)
        P = ctypes.c_void_p * 1
        for m in (int(v) for v in args.tokens.split(",")):
            x = np.random.default_rng(m).standard_normal((m, c)).astype(np.float32)
            first, tok, wt = np.array([0, m], np.int32), np.arange(m, dtype=np.int32), np.full(m, 0.5, np.float32)
            outs = {name: np.zeros((m, c), np.float32) for name in libs}
            times = {name: [] for name in libs}
            for _ in range(args.repeats + 1):
                for name, lib in libs.items():
                    t0 = clock()
                    lib.moe_ffn(x.ctypes.data, m, c, f, 1, P(g.ctypes.data), P(u.ctypes.data), P(d.ctypes.data),
                                int(T.Q4_K), int(T.Q4_K), int(T.Q6_K), first.ctypes.data, tok.ctypes.data,
                                wt.ctypes.data, outs[name].ctypes.data)
                    times[name].append(clock() - t0)
            assert np.array_equal(outs["old"], outs["new"])
            report("moe_ffn", f"{f}x{c}", m, {a: statistics.median(v[1:]) for a, v in times.items()}, 3 * m * f * c)
    return 0


def report(op: str, shape: str, m: int, s: dict, macs: int) -> None:
    print(f"{op:10} {shape:>10} {m:>4} {s['old'] * 1e3:8.2f} {s['new'] * 1e3:8.2f} {macs / s['old'] / 1e9:10.1f} "
          f"{macs / s['new'] / 1e9:10.1f} {s['old'] / s['new']:5.2f}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
