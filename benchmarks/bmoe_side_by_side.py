"""MawForge against BigMoeOnEdge (the strongest CPU expert-streaming peer, built from source by
scripts/bmoe_build.py) on the same GGUF, in the same run: whole model in memory and inside a cgroup
v1 memory limit, exact and lossy, engines alternated (the pairs run in ABBA order).

    python benchmarks/bmoe_side_by_side.py --model GGUF [--limits none,8] [--tokens 96] [--pairs 2]
        [--miss-policy skip:0.1] [--record]

Both engines take the same text prompt and *sample* their tokens (temperature 1.0, a seed per pair;
greedy decoding on random weights repeats one token and would hit the same experts every step).
They sample different tokens from their own logits, so the routing each sees is alike in kind,
not token for token. Rows:

- MawForge exact: `mawforge run --pack P PROMPT --temperature 1 --telemetry-json` with its defaults
  (the budget is the cgroup's limit less 8%, or the machine's available memory; S3-FIFO, auto
  prefetch with router lookahead, O_DIRECT reads).
- MawForge lossy (limited rows): the same with `--miss-policy` (docs/miss-policy.md prices it).
- BigMoeOnEdge lossless: `bmoe-cli --moe-stream --cache-mb C --io-threads 4 --dense-weights anon
  -t 2`, its documented best streaming settings; C = 5500 inside 8 GiB (the figure its authors and
  the issue that named it used), scaled with other limits, and every expert's bytes when whole.
- BigMoeOnEdge k=6 (limited rows): the same with `--n-expert-used 6`, its lossy mode.

Every row is cold: the page cache is dropped before it and each engine reads its experts as its
tokens ask. Decode tok/s is each engine's own figure (MawForge: first token to last; BigMoeOnEdge:
its `generation:` line, decode calls only). The CPU model and a quiet check are recorded.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from bmoe import BmoeError, bmoe_binary, run_bmoe  # noqa: E402
from common import (finish_record, PY, commit, cpu_kind, drop_caches, machine, median, pack_of, quiet,  # noqa: E402
                    run_measured)

GiB = 2**30
PROMPT = ("The history of the transistor begins in the nineteen twenties, when physicists first proposed that a "
          "solid crystal could control an electric current the way a vacuum tube did. Decades of work on "
          "semiconductors followed, and by the late nineteen forties a small team at Bell Labs had built a "
          "working point-contact device. Explain how that invention changed computing over the next fifty years.")


@contextlib.contextmanager
def limited(limit_gib: float | None):
    """A cold row inside limit_gib: yields what wraps a command into the limit's cgroup (None: whole
    machine), the page cache dropped first; the cgroup is removed after."""
    if limit_gib is None:
        drop_caches()
        yield None
        return
    from mawforge.bench.cgroup import MemoryCgroup
    with MemoryCgroup(int(limit_gib * GiB)) as cg:
        drop_caches()
        yield cg.wrap


def mawforge_row(pack: Path, limit_gib: float | None, tokens: int, seed: int, policy: str) -> dict:
    cmd = [PY, "-m", "mawforge.cli", "run", "--pack", str(pack), PROMPT, "--max-tokens", str(tokens),
           "--temperature", "1.0", "--seed", str(seed), "--ignore-eos", "--telemetry-json", "--threads", "2",
           "--miss-policy", policy]
    with limited(limit_gib) as wrap:
        r = run_measured(wrap(cmd) if wrap else cmd, timeout=3600)
    row = {"engine": "mawforge", "setting": policy, "cmd": cmd, "peak_rss_bytes": r.get("peak_rss_bytes", 0),
           "wall_s": r["wall_s"], "status": "ok" if r["rc"] == 0 else f"failed rc={r['rc']}"}
    if r["rc"] != 0:
        row["stderr_tail"] = r["stderr"][-800:]
        return row
    lines = [ln for ln in r["stderr"].splitlines() if ln.startswith("{")]     # run prints telemetry on stderr
    if not lines:
        row.update(status="failed: no telemetry", stderr_tail=r["stderr"][-800:])
        return row
    tele = json.loads(lines[-1])
    row.update(decode_tok_s=tele["decode_tok_s"], ttft_s=tele["ttft_s"], prompt_tokens=tele["prompt_tokens"],
               hit_rate=tele["hit_rate"], n_generated=tele["completion_tokens"],
               # expert bytes read while decoding (demand and prefetch), as bmoe-cli's `moe-stream: read`
               read_bytes_per_token=(tele["materialized_bytes"] + tele["prefetched_bytes"] - tele["prefill_read_bytes"])
               / max(1, tele["completion_tokens"]),
               materialized_bytes=tele["materialized_bytes"], prefetched_bytes=tele["prefetched_bytes"],
               prefill_read_bytes=tele["prefill_read_bytes"], miss_policy=tele["miss_policy"])
    return row


def bmoe_row(model: Path, limit_gib: float | None, tokens: int, seed: int, k: int | None, all_mb: int) -> dict:
    cache_mb = all_mb if limit_gib is None else int(5500 * limit_gib / 8)
    row = {"engine": "bigmoeonedge", "setting": "lossless" if k is None else f"n-expert-used {k}",
           "cache_mb": cache_mb}
    try:
        with limited(limit_gib) as wrap:
            r = run_bmoe(model, PROMPT, tokens, cache_mb, io_threads=4, threads=2, n_expert_used=k, seed=seed,
                         temp=1.0, wrap=wrap)
        row.update(r, status="ok")
        row["ttft_s"] = r["load_s"] + r["prefill_s"]
    except BmoeError as e:
        row.update(status="failed", error=str(e)[-800:])
    return row


def expert_mb(pack: Path) -> int:
    from mawforge.pack.manifest import read_index
    return int(read_index(pack).total_bytes() / 2**20) + 64


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the GGUF both engines run (MawForge packs it beside it once)")
    ap.add_argument("--limits", default="none,8", help="GiB, comma-separated; none: the whole machine")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--miss-policy", default="skip:0.1", help="MawForge's lossy row")
    ap.add_argument("--record", action="store_true", help="also write benchmarks/records/bmoe_side_by_side-COMMIT.json")
    a = ap.parse_args(argv)
    if bmoe_binary() is None:
        raise SystemExit("no bmoe-cli: run `python scripts/bmoe_build.py` first")
    model = Path(a.model)
    pack = pack_of(model)
    all_mb = expert_mb(pack)
    q0 = quiet()
    rec = {"benchmark": "bmoe_side_by_side", "commit": commit(), "machine": machine(), "cpu": cpu_kind(),
           "command": " ".join(sys.argv), "model": model.name, "decode": "sampled, temperature 1.0",
           "tokens": a.tokens, "quiet_before": q0, "configs": []}
    print(f"# {rec['machine']}\n# {rec['cpu']['kind']}; quiet: load {q0['loadavg'][0]:.2f}, "
          f"busy {[b['name'] for b in q0['busy']]}")
    for lim in a.limits.split(","):
        limit = None if lim == "none" else float(lim)
        where = "whole model in memory" if limit is None else f"inside {limit:g} GiB"
        jobs = [("mawforge", "exact"), ("bigmoeonedge", None)]
        if limit is not None:
            jobs += [("mawforge", a.miss_policy), ("bigmoeonedge", 6)]
        rows = []
        for pair in range(a.pairs):
            order = jobs if pair % 2 == 0 else jobs[::-1]
            for engine, arg in order:
                seed = 100 + pair
                row = (mawforge_row(pack, limit, a.tokens, seed, arg) if engine == "mawforge"
                       else bmoe_row(model, limit, a.tokens, seed, arg, all_mb))
                row.update(pair=pair, seed=seed, limit_gib=limit)
                rows.append(row)
                fail = row["status"] + " " + row.get("stderr_tail", row.get("error", ""))[-300:]
                print(f"{where:>22} pair {pair} {engine:>12} {row['setting']:>16}: " + (
                    f"{row['decode_tok_s']:.2f} tok/s, hit {100 * (row.get('hit_rate') or 0):.1f}%, "
                    f"{(row.get('read_bytes_per_token') or 0) / 2**20:.1f} MiB read/token, TTFT {row['ttft_s']:.1f} s"
                    if row["status"] == "ok" else fail), flush=True)
        summary = {}
        for engine, arg in jobs:
            ok = [r["decode_tok_s"] for r in rows if r["engine"] == engine and r["status"] == "ok"
                  and r["setting"] == (arg if engine == "mawforge" else "lossless" if arg is None
                                       else f"n-expert-used {arg}")]
            summary[f"{engine} {arg or 'lossless'}"] = median(ok)
        ours, theirs = summary["mawforge exact"], summary["bigmoeonedge lossless"]
        print(f"## {where}: median decode MawForge exact {ours:.2f} / BigMoeOnEdge lossless {theirs:.2f} tok/s "
              f"= {ours / theirs:.2f}x" + ("" if limit is None else
                                          f"; lossy MawForge {a.miss_policy} {summary[f'mawforge {a.miss_policy}']:.2f}"
                                          f" / BigMoeOnEdge k=6 {summary['bigmoeonedge 6']:.2f} = "
                                          f"{summary[f'mawforge {a.miss_policy}'] / summary['bigmoeonedge 6']:.2f}x"))
        rec["configs"].append({"limit_gib": limit, "rows": rows, "median_decode_tok_s": summary})
    finish_record("bmoe_side_by_side", rec, a.record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
