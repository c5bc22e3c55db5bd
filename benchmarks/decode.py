"""Decode and prefill against llama.cpp (llama-cpp-python, same file, same thread count) in the
same run, on shape-true Qwen3-30B-A3B-dimension GGUFs, resident and inside cgroup v1 memory
limits. Each measurement runs in its own child process (and cgroup when limited).

    python benchmarks/decode.py [--layers 8,24] [--skew 0,1.0] [--decode-tokens 32]

Decode is teacher-forced over a fixed random token sequence (a greedy loop on random weights
repeats one token and would hit the same experts every step).
"""
from __future__ import annotations

import argparse
import json
import statistics
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import llama_repack_off, machine, pack_of, save, synth_model, worker_parser, worker_row  # noqa: E402

THREADS = int(os.environ.get("MAWFORGE_BENCH_THREADS", "2"))   # each engine, same count


def tokens(n: int, seed: int, vocab: int = 151000) -> list[int]:
    import numpy as np
    return [int(t) for t in np.random.default_rng(seed).integers(1000, vocab, n)]


# ---- workers (run in a child process) ------------------------------------------------------
def work_llama(a) -> dict:
    import llama_cpp
    if a.no_repack:
        llama_repack_off()
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(a.model, n_ctx=a.context, n_batch=512, n_threads=THREADS, n_threads_batch=THREADS,
                          verbose=False, use_mmap=not a.no_mmap)
    load = time.perf_counter() - t0
    prompt, dec = tokens(a.prompt_tokens, 1), tokens(a.decode_tokens, 2)
    t0 = time.perf_counter()
    llm.eval(prompt)
    prefill = time.perf_counter() - t0
    times = []
    for t in dec:
        t0 = time.perf_counter()
        llm.eval([t])
        times.append(time.perf_counter() - t0)
    warm = times[a.warmup:]
    return {"load_s": load, "prefill_tok_s": len(prompt) / prefill, "ttft_s": prefill,
            "decode_tok_s": len(warm) / sum(warm)}


def work_maw(a) -> dict:
    import torch

    from mawforge.engine.runtime import Runtime, RuntimeOptions
    from mawforge.plan import Budget
    torch.set_num_threads(THREADS)
    t0 = time.perf_counter()
    budget = None if a.budget_gib is None else Budget.from_gib(a.budget_gib, "--budget-gib")
    rt = Runtime(a.pack, RuntimeOptions(context=a.context, expert_cache_percent=a.cache_percent,
                                        budget=budget, prefill_chunk=a.prefill_chunk, threads=THREADS,
                                        check_digests=False, stream_embeddings=a.stream_embeddings,
                                        prefetch=a.prefetch,
                                        thread_governor=not a.no_thread_governor))
    if a.preload:
        rt.cache.preload()
    load = time.perf_counter() - t0
    prompt, dec = tokens(a.prompt_tokens, 1), tokens(a.decode_tokens, 2)
    s0 = rt.cache.stats()
    t0 = time.perf_counter()
    rt.forward(prompt)
    prefill = time.perf_counter() - t0
    times, s_warm, read_warm = [], None, 0
    for i, t in enumerate(dec):
        if i == a.warmup:
            s_warm, read_warm = rt.cache.stats(), rt.store.bytes_read
        t0 = time.perf_counter()
        rt.forward([t], kind="decode")
        times.append(time.perf_counter() - t0)
    s1 = rt.cache.stats()
    warm = times[a.warmup:]
    hits, misses = s1["hits"] - s_warm["hits"], s1["misses"] - s_warm["misses"]
    return {"load_s": load, "prefill_tok_s": len(prompt) / prefill, "ttft_s": prefill,
            "decode_tok_s": len(warm) / sum(warm), "hit_rate": hits / max(1, hits + misses),
            "materialized_bytes_per_token": (s1["materialized_bytes"] - s_warm["materialized_bytes"]) / len(warm),
            "read_bytes_per_token": (rt.store.bytes_read - read_warm) / len(warm),   # demand and prefetch
            "prefill_materialized_bytes": s_warm["materialized_bytes"] - s0["materialized_bytes"],
            "materialize_gb_s": s1["demand_loaded_bytes"] / max(1e-9, s1["load_seconds"]) / 1e9,
            "expert_cache_bytes": rt.plan.E, "planned_F": rt.plan.F, "cache_percent": rt.plan.cache_percent,
            "compute_threads": rt.governor.report() if rt.governor is not None else None}


def work_pread(a) -> dict:
    """Raw O_DIRECT pread bandwidth of random expert blocks, 1 and 4 threads (MawForge's pool)."""
    import mmap
    import random
    from concurrent.futures import ThreadPoolExecutor

    from mawforge.pack.manifest import EXPERTS, read_index
    index = read_index(a.pack)
    blocks = [(lb.offsets[e], lb.block_nbytes) for lb in index.layers for e in range(len(lb.offsets))]
    fd = os.open(os.path.join(a.pack, EXPERTS), os.O_RDONLY | os.O_DIRECT)
    out = {}
    for threads in (1, 4):
        rng = random.Random(threads)
        bufs = [mmap.mmap(-1, -(-max(n for _, n in blocks) // 4096) * 4096) for _ in range(threads)]

        def read(i):
            off, n = rng.choice(blocks)
            return os.preadv(fd, [memoryview(bufs[i % threads])[:-(-n // 4096) * 4096]], off)
        total, t0 = 0, time.perf_counter()
        with ThreadPoolExecutor(threads) as ex:
            while time.perf_counter() - t0 < 3.0:
                total += sum(ex.map(read, range(threads * 8)))
        out[f"pread_{threads}t_gb_s"] = total / (time.perf_counter() - t0) / 1e9
    return out


# ---- driver --------------------------------------------------------------------------------
def child(args: list[str], limit_bytes: int | None = None, timeout: float = 1800) -> dict:
    return worker_row(__file__, args, limit_bytes, timeout)


def run_model(layers: int, skew: float, a) -> list[dict]:
    stick = 0.3 if skew else 0.0
    gguf = synth_model(layers, "Q4_K_M", skew=skew, stickiness=stick)
    pack = pack_of(gguf)
    size = os.path.getsize(gguf)
    common = ["--prompt-tokens", str(a.prompt_tokens), "--decode-tokens", str(a.decode_tokens),
              "--warmup", str(a.warmup)]
    rows = []

    def add(name, r):
        r.update(model=gguf.name, layers=layers, skew=skew, config=name, file_bytes=size)
        rows.append(r)
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()
                          if k not in ("cgroup", "stderr_tail")}), flush=True)

    if not a.only_limits:
        # resident pairs alternate the engines, so a slow spell of this noisy VM hits both
        for _ in range(a.resident_pairs):
            add("llama.cpp resident", child(["llama", "--model", str(gguf), *common]))
            add("mawforge 100%", child(["maw", "--pack", str(pack), "--cache-percent", "100", "--preload", *common]))
    if not a.only_limits and not a.only_resident:
        for p in (50, 25):
            add(f"mawforge {p}%", child(["maw", "--pack", str(pack), "--cache-percent", str(p), *common]))
        add("raw pread", child(["pread", "--pack", str(pack)]))
    if a.limits:
        for frac in (0.5, 0.25):
            limit = int(size * frac)
            gib = limit / 2**30
            add(f"llama.cpp default mmap @{int(frac * 100)}%",
                child(["llama", "--model", str(gguf), *common], limit, timeout=a.llama_limit_timeout))
            add(f"llama.cpp no-repack @{int(frac * 100)}%",
                child(["llama", "--model", str(gguf), "--no-repack", "--prompt-tokens", "16",
                       "--decode-tokens", str(a.limit_decode_tokens), "--warmup", "1"], limit,
                      timeout=a.llama_limit_timeout))
            # the budget leaves 8% of the limit to the page cache and the kernel; the embedding
            # table is streamed from the pack (only the rows a request needs are read)
            add(f"mawforge @{int(frac * 100)}%",
                child(["maw", "--pack", str(pack), "--budget-gib", f"{gib * 0.92:.3f}", "--stream-embeddings",
                       *common], limit))
    return rows


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        ap = worker_parser(("llama", "maw", "pread"))
        ap.add_argument("--stream-embeddings", action="store_true")
        ap.add_argument("--no-mmap", action="store_true")
        ap.add_argument("--no-thread-governor", action="store_true", help="MawForge: keep every step at THREADS")
        ap.add_argument("--context", type=int, default=512)
        ap.add_argument("--prefill-chunk", type=int, default=64, help="MawForge's prefill chunk")
        ap.add_argument("--prefetch", default="auto", help="MawForge's --prefetch (auto, none, or a policy)")
        a = ap.parse_args()
        print(json.dumps({"llama": work_llama, "maw": work_maw, "pread": work_pread}[a.engine](a)))
        return 0
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", default="8,24")
    ap.add_argument("--skew", default="0")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--no-limits", dest="limits", action="store_false")
    ap.add_argument("--only-limits", action="store_true", help="skip the unlimited rows")
    ap.add_argument("--limit-decode-tokens", type=int, default=4)
    ap.add_argument("--resident-pairs", type=int, default=1,
                    help="alternating llama.cpp / MawForge resident runs; "
                         "the summary gives each pair's ratio and the median")
    ap.add_argument("--only-resident", action="store_true", help="only the resident pairs (implies --no-limits)")
    ap.add_argument("--llama-limit-timeout", type=float, default=600)
    a = ap.parse_args()
    if a.only_resident:
        a.limits = False
    rows = []
    for layers in [int(x) for x in a.layers.split(",")]:
        for skew in [float(x) for x in a.skew.split(",")]:
            rows += run_model(layers, skew, a)
    print(f"\n# decode benchmark, {machine()}, {THREADS} threads each")
    print(f"{'model':44s} {'config':28s} {'status':12s} {'prefill t/s':>11s} {'TTFT s':>7s} {'decode t/s':>10s} "
          f"{'hit %':>6s} {'peak RSS GiB':>12s}")
    for r in rows:
        print(f"{r['model'][:44]:44s} {r['config']:28s} {r['status'][:12]:12s} {r.get('prefill_tok_s', 0):11.2f} "
              f"{r.get('ttft_s', 0):7.2f} {r.get('decode_tok_s', 0):10.3f} {100 * r.get('hit_rate', 0):6.1f} "
              f"{r['peak_rss_bytes'] / 2**30:12.2f}")
    for model in dict.fromkeys(r["model"] for r in rows):
        ll = [r for r in rows if r["model"] == model and r["config"] == "llama.cpp resident" and r["status"] == "ok"]
        mw = [r for r in rows if r["model"] == model and r["config"] == "mawforge 100%" and r["status"] == "ok"]
        if len(ll) == len(mw) > 0:
            dec = [m["decode_tok_s"] / l["decode_tok_s"] for l, m in zip(ll, mw)]
            pre = [m["prefill_tok_s"] / l["prefill_tok_s"] for l, m in zip(ll, mw)]
            print(f"{model}: resident decode ratio per pair {', '.join(f'{x:.2f}' for x in dec)} "
                  f"(median {statistics.median(dec):.2f}); prefill {', '.join(f'{x:.2f}' for x in pre)} "
                  f"(median {statistics.median(pre):.2f})")
    print(f"saved {save('decode', {'machine': machine(), 'rows': rows})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
