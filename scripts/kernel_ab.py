"""In-process A/B of two versions of one native kernel source, on resident decode.

    python scripts/kernel_ab.py PACK A.c B.c [--source kquant_gemm.c] [--tokens 96] [--block 4]

Both versions are compiled (the library cache of mawforge.kernels.native), both libraries are
loaded, and the runtime switches between them every --block decode tokens (teacher-forced,
random tokens, the whole pack preloaded). On a VM whose speed drifts by 20-40% within an hour
(L3 and memory bandwidth shared with other guests), separate runs of each version cannot show
a 5-10% change; alternating inside one process can. Prints each version's median ms a token
and B's speed relative to A's. The source file in the tree is restored whatever happens. Time
nothing else on the machine while it runs.
"""
from __future__ import annotations

import argparse
import ctypes
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from mawforge.kernels import native  # noqa: E402


def _load(src: Path, text: bytes) -> ctypes.CDLL:
    src.write_bytes(text)
    cc = shutil.which("cc") or shutil.which("gcc")
    lib, err = native._compile(cc, "native", Path.home() / ".cache" / "mawforge")
    if lib is None:
        raise SystemExit(f"compile failed:\n{err}")
    dll = ctypes.CDLL(str(lib))
    for name, args in native._SIGNATURES:
        f = getattr(dll, name)
        f.argtypes = args
        f.restype = None if name in native._VOID else ctypes.c_int
    return dll


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pack")
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--source", default="kquant_gemm.c", choices=[s.name for s in native.SOURCES])
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--block", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    from decode import tokens       # benchmarks/decode.py's teacher-forced token stream

    src = next(s for s in native.SOURCES if s.name == a.source)
    keep = src.read_bytes()
    try:
        libs = [_load(src, Path(f).read_bytes()) for f in (a.a, a.b)]
    finally:
        src.write_bytes(keep)
    for lib in libs:
        lib.set_threads(a.threads)
    native._lib, native._tried, native._threads = libs[0], True, a.threads
    torch.set_num_threads(a.threads)
    from mawforge.engine.runtime import Runtime, RuntimeOptions
    rt = Runtime(a.pack, RuntimeOptions(context=1024, expert_cache_percent=100, prefill_chunk=512,
                                        threads=a.threads, check_digests=False))
    try:
        rt.cache.preload()
        rt.forward(tokens(64, 1))
        times: list[list[float]] = [[], []]
        for i, t in enumerate(tokens(a.tokens, 2)):
            which = (i // a.block) % 2
            native._lib = libs[which]
            t0 = time.perf_counter()
            rt.forward([t], kind="decode")
            if i >= 2 * a.block:                    # one block of each as warm-up
                times[which].append(time.perf_counter() - t0)
    finally:
        rt.close()
    ma, mb = (statistics.median(t) for t in times)
    print(f"A {Path(a.a).name}: {ma * 1e3:.1f} ms a token; B {Path(a.b).name}: {mb * 1e3:.1f} ms; "
          f"B's speed / A's {ma / mb:.3f} (n = {len(times[0])}, {len(times[1])})")


if __name__ == "__main__":
    main()
