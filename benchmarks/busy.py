"""Decode on a busy machine: MawForge (resident, 100% cache, preloaded) and llama.cpp on the same
shape-true GGUF, quiet and with N CPU-bound processes beside them, in the same run. Prints each
engine's busy/quiet ratio: the share of its quiet speed it keeps when another program takes a core.

    python benchmarks/busy.py [--layers 8] [--busy 1] [--decode-tokens 32] [--repeats 2]
    python benchmarks/busy.py --layers 48 --limit-gib 8 --decode-tokens 12 --repeats 1

Rows alternate quiet and busy for each engine and thread count, so a slow spell of this VM hits
both. The load is a pure-Python spin loop per busy process (one core each).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
from common import PY, drop_caches, machine, pack_of, save, synth_model  # noqa: E402

DECODE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "decode.py")
SPIN = "x = 0\nwhile True:\n    x += 1\n"


def measure(engine: str, args: list[str], threads: int, busy: int, limit_bytes: int | None = None) -> dict:
    """One decode.py worker with `busy` spinning processes beside it; under a limit it runs in a
    cgroup v1 memory group on a dropped page cache (the spinners stay outside the group)."""
    cmd, cg = [PY, DECODE, "worker", engine, *args], None
    if limit_bytes:
        from mawforge.bench.cgroup import MemoryCgroup
        cg = MemoryCgroup(limit_bytes).__enter__()
        cmd = cg.wrap(cmd)
        drop_caches()
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(busy)]
    try:
        env = dict(os.environ, MAWFORGE_BENCH_THREADS=str(threads))
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    finally:
        for p in spinners:
            p.kill()
            p.wait()
        if cg:
            cg.close()
    lines = [l for l in r.stdout.splitlines() if l.startswith("{")]
    row = json.loads(lines[-1]) if r.returncode == 0 and lines else {"error": r.stderr[-400:]}
    row.update(engine=engine, threads=threads, busy=busy)
    print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--busy", type=int, default=1, help="CPU-bound processes beside the engine")
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--limit-gib", type=float, default=None,
                    help="run inside a cgroup memory limit: llama.cpp repack off (its load that fits) against "
                         "MawForge with a budget of 92%% of the limit")
    a = ap.parse_args(argv)
    gguf = synth_model(a.layers, "Q4_K_M", skew=1.0, stickiness=0.3)
    pack = pack_of(gguf)
    common = ["--prompt-tokens", "64", "--decode-tokens", str(a.decode_tokens), "--warmup", "4"]
    limit = int(a.limit_gib * 2**30) if a.limit_gib else None
    if limit is None:
        maw = ["--pack", str(pack), "--cache-percent", "100", "--preload"]
        setups = {("llama.cpp", 2): ("llama", ["--model", str(gguf)]),
                  ("mawforge fixed", 2): ("maw", maw + ["--no-thread-governor"]),
                  ("mawforge fixed", 1): ("maw", maw + ["--no-thread-governor"]),
                  ("mawforge governed", 2): ("maw", maw)}
    else:
        maw = ["--pack", str(pack), "--budget-gib", f"{a.limit_gib * 0.92:.3f}", "--stream-embeddings"]
        setups = {("llama.cpp repack off", 2): ("llama", ["--model", str(gguf), "--no-repack"]),
                  ("mawforge governed", 2): ("maw", maw)}
    rows = []
    for _ in range(a.repeats):
        for (name, threads), (engine, args) in setups.items():
            for busy in (0, a.busy):
                rows.append(measure(engine, args + common, threads, busy, limit) | {"name": name})
    where = f", inside a {a.limit_gib:g} GiB limit" if limit else ", resident"
    print(f"\n# busy machine, {machine()}, {a.layers} layers{where}, {a.busy} spinning process(es) beside")
    print(f"{'engine':18s} {'threads':>7s} {'quiet tok/s':>11s} {'busy tok/s':>10s} {'kept':>6s}")
    quiet2 = {}
    for (name, threads) in setups:
        q = [r["decode_tok_s"] for r in rows if r["name"] == name and r["threads"] == threads and r["busy"] == 0]
        b = [r["decode_tok_s"] for r in rows if r["name"] == name and r["threads"] == threads and r["busy"]]
        mq, mb = statistics.median(q), statistics.median(b)
        quiet2.setdefault(name.split()[0], mq)
        print(f"{name:18s} {threads:7d} {mq:11.2f} {mb:10.2f} {mb / mq:6.2f}  (of its own quiet speed; "
              f"{mb / quiet2[name.split()[0]]:.2f} of the engine's first row's quiet speed)")
    print(f"saved {save('busy', {'machine': machine(), 'rows': rows})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
