"""Replay speed: block accesses per second for each policy on a Qwen3-30B-A3B-sized
SYNTHETIC trace (48 layers x 128 experts, top-8, 10,000 decode steps by default).

The peer, measured in the same run over the same access sequence, is a bare OrderedDict
LRU loop with no bytes, pins, groups or counters: the ratio says what the shared
live/replay machinery (RouteDriver + CacheCore + policy) costs per access.

    .venv/bin/python benchmarks/replay.py                 # full size: run it once
    .venv/bin/python benchmarks/replay.py --steps 300     # a quick look
"""

from __future__ import annotations

import argparse
import json
import time
from collections import OrderedDict

from mawforge.trace.oracle import access_sequence, belady
from mawforge.trace.replay import parse_budget, replay_policy
from mawforge.trace.synthetic import SyntheticSpec, synthetic_trace

# Qwen3-30B-A3B expert: gate, up, down of 2048 x 768 at Q4_K (144 bytes per 256 weights),
# rounded up to the pack's 64 KiB block alignment.
QWEN3_30B_A3B_BLOCK = -(-3 * 2048 * 768 * 144 // 256 // 65536) * 65536


def bare_lru(keys: list[int], capacity_blocks: int) -> int:
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for k in keys:
        if k in cache:
            hits += 1
            cache.move_to_end(k)
        else:
            if len(cache) >= capacity_blocks:
                cache.popitem(last=False)
            cache[k] = None
    return hits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--budget", default="25%")
    ap.add_argument("--policies", default="lru,lfu,fifo,random:0,s3fifo,belady,belady-pinned")
    ap.add_argument("--prefetch", default="none")
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--reuse", type=float, default=0.3)
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args()

    t0 = time.perf_counter()
    trace = synthetic_trace(SyntheticSpec(
        n_layers=args.layers, n_experts=args.experts, top_k=args.top_k, decode_steps=args.steps,
        zipf=args.zipf, reuse=args.reuse, block_bytes=QWEN3_30B_A3B_BLOCK, seed=0))
    seq = access_sequence(trace)
    n = len(seq.keys)
    gen_s = time.perf_counter() - t0
    cap = parse_budget(args.budget, trace.total_expert_bytes).capacity_bytes
    print(f"SYNTHETIC trace: {args.layers} layers x {args.experts} experts, top-{args.top_k}, "
          f"{args.steps} steps, {n} accesses, built in {gen_s:.1f}s; budget {args.budget} = "
          f"{cap / 2**30:.2f} GiB")

    t0 = time.perf_counter()
    bare_hits = bare_lru(seq.keys.tolist(), cap // QWEN3_30B_A3B_BLOCK)
    peer = n / (time.perf_counter() - t0)
    results = [dict(policy="bare-lru (peer)", accesses_per_s=peer, ratio=1.0, hit_rate=bare_hits / n)]
    for policy in args.policies.split(","):
        t0 = time.perf_counter()
        if policy.startswith("belady"):
            stats = belady(seq, cap, pinned=policy == "belady-pinned")
        else:
            stats = replay_policy(trace, cap, policy, args.prefetch)
        rate = stats.accesses / (time.perf_counter() - t0)
        results.append(dict(policy=policy, accesses_per_s=rate, ratio=rate / peer, hit_rate=stats.hit_rate))

    print(f"{'policy':<18}{'accesses/s':>14}{'vs peer':>10}{'hit rate':>10}")
    for r in results:
        print(f"{r['policy']:<18}{r['accesses_per_s']:>14,.0f}{r['ratio']:>10.3f}{100 * r['hit_rate']:>9.2f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(config=vars(args), accesses=n, capacity_bytes=cap, synthetic=True,
                           results=results), f, indent=1)


if __name__ == "__main__":
    main()
