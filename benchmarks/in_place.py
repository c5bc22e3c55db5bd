"""An in-place pack (experts read from the GGUF where they lie) against a copied pack of the same
file: decode and prefill, resident and inside a cgroup v1 memory limit, A/B pairs alternating which
goes first, in the same run.

    python benchmarks/in_place.py [--layers 48] [--limit-gib 8] [--pairs 2] [--record]

Rows of one configuration run in ABBA order (pairs alternate which pack goes first): the host's
cache of the VM's disk keeps what a row just read for the next one, which favours the pack read
most recently (seen as the second row of each pair running up to 1.4x the first).

The model is the shape-true Qwen3-30B-A3B file (`mawforge synth`, Q4_K_M, skew 1.0, stickiness
0.3; built once under work/bench). Each row is one child process of benchmarks/decode.py's
MawForge worker on a dropped page cache: a random-id prompt, then teacher-forced decode of random
ids. Resident rows hold every expert (cache 100%, read in before timing); limited rows plan for
92% of the limit and stream the embeddings, as benchmarks/decode.py does.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from common import (finish_record, commit, cpu_kind, machine, median, pack_of, quiet, synth_model,  # noqa: E402
                    worker_row)

GiB = 2**30
DECODE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "decode.py")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--limit-gib", type=float, default=8.0)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--configs", default="resident,limit", help="which rows: resident, limit or both")
    ap.add_argument("--record", action="store_true", help="also write the record to benchmarks/records/")
    a = ap.parse_args()
    gguf = synth_model(a.layers, "Q4_K_M", skew=1.0, stickiness=0.3)
    packs = {"copied": str(pack_of(gguf)), "in place": str(pack_of(gguf, in_place=True))}
    common = ["--prompt-tokens", str(a.prompt_tokens), "--decode-tokens", str(a.decode_tokens),
              "--warmup", str(a.warmup), "--context", "512"]
    configs = {"resident": (["--cache-percent", "100", "--preload"], None),
               f"{a.limit_gib:g} GiB": (["--budget-gib", f"{a.limit_gib * 0.92:.3f}", "--stream-embeddings"],
                                        int(a.limit_gib * GiB))}
    want = a.configs.split(",")
    configs = {k: v for k, v in configs.items() if ("resident" if k == "resident" else "limit") in want}
    record = {"bench": "in_place", "machine": machine(), "cpu": cpu_kind(), "commit": commit(), "model": gguf.name,
              "tokens": "random ids: a prompt, then decode teacher-forced", "quiet_before": quiet(), "rows": []}
    for i in range(a.pairs):
        for cfg, (extra, limit) in configs.items():
            order = list(packs) if i % 2 == 0 else list(packs)[::-1]
            for kind in order:
                r = worker_row(DECODE, ["maw", "--pack", packs[kind], *extra, *common], limit)
                r.pop("cgroup", None)
                r.update(pack=kind, config=cfg, pair=i)
                record["rows"].append(r)
                print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()
                                  if k in ("pack", "config", "pair", "status", "decode_tok_s", "prefill_tok_s",
                                           "hit_rate", "peak_rss_bytes")}), flush=True)
    print(f"\n# in-place against copied, {machine()}; {gguf.name}")
    print(report(record))
    finish_record("in_place", record, a.record)
    return 0


def report(record: dict) -> str:
    """Per configuration: each pack's median decode and prefill over the pairs, and in place / copied."""
    lines = ["| configuration | pack | decode tok/s (median) | prefill tok/s (median) | hit rate | in place / copied |",
             "|---|---|---|---|---|---|"]
    cfgs = dict.fromkeys(r["config"] for r in record["rows"])
    for cfg in cfgs:
        med = {}
        for kind in ("copied", "in place"):
            rows = [r for r in record["rows"] if r["config"] == cfg and r["pack"] == kind and r["status"] == "ok"]
            med[kind] = (median([r["decode_tok_s"] for r in rows]), median([r["prefill_tok_s"] for r in rows]),
                         median([r["hit_rate"] for r in rows]))
        for kind, (dec, pre, hit) in med.items():
            ratio = f"{dec / med['copied'][0]:.3f}x decode, {pre / med['copied'][1]:.3f}x prefill" \
                if kind == "in place" else ""
            lines.append(f"| {cfg} | {kind} | {dec:.2f} | {pre:.1f} | {hit * 100:.1f}% | {ratio} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
