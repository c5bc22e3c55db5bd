"""Decode at long contexts on the full-size file (issue 27, item 3): tok/s at 4K, 16K and 32K
tokens of context, MawForge resident and inside a memory limit against llama.cpp resident, at
the same positions in the same run, with each child's peak RSS beside MawForge's planned F.

Prefilling 32K tokens of a 48-layer file takes hours on 2 cores, so both engines start from a
cache whose first N positions hold synthetic keys and values (the same float16 rows for both):
MawForge writes them into its KV cache, llama.cpp loads them as a sequence state file in its own
format (`benchmarks/fullsize.py` SeqState, laid out from a state llama.cpp saved itself). What a
decode step costs does not depend on the values: each step attends over N positions (plus the
steps before it) and runs the experts its token routes to. Then one token at position N and
--decode-tokens teacher-forced steps (the first --warmup not timed).

    python benchmarks/long_context.py [--contexts 4096,16384,32768] [--limits 8] [--rounds 1]
        [--engines maw,llama,llama-fa,maw-q8,llama-q8] [--limit-engines maw,maw-q8]

Engines alternate within each round; llama.cpp loads with repack off (its default load needs
more memory than this machine has), once with llama-cpp-python's default (flash attention off)
and once with flash attention on (`llama-fa`: what a long-context user would turn on), and runs
resident only (inside 8 GiB it decodes at ~0.1
tok/s at short context: RESULTS.md). Reported per context: each engine's decode tok/s (median
over rounds), MawForge / llama.cpp (target >= 1.0), peak RSS and, for MawForge, the plan's F.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import fill_args, machine, pack_of, save, synth_model, worker_row  # noqa: E402

FULLSIZE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fullsize.py")
GiB = 2**30


# engine -> (worker engine, extra worker arguments); -q8: the KV cache in q8_0 (llama.cpp's
# --cache-type-k/v q8_0 needs flash attention and turns it on)
ENGINES = {"maw": ("maw", []), "maw-q8": ("maw", ["--kv-dtype", "q8_0"]), "llama": ("llama", []),
           "llama-fa": ("llama", ["--flash-attn"]), "llama-q8": ("llama", ["--kv-dtype", "q8_0"])}


def row(engine: str, gguf, pack, n: int, decode: int, warmup: int, limit: float | None) -> dict:
    worker, extra = ENGINES[engine]
    args = [worker, *fill_args(n, decode, warmup), *extra]
    if worker == "llama":
        args += ["--model", str(gguf), "--no-repack"]
    elif limit:
        args += ["--pack", str(pack), "--budget-gib", f"{0.92 * limit:.3f}"]
    else:
        args += ["--pack", str(pack), "--cache-percent", "100", "--preload"]
    r = worker_row(FULLSIZE, args, int(limit * GiB) if limit else None, timeout=3600)
    keep = ("status", "load_s", "fill_s", "context_at_decode", "decode_tok_s", "read_bytes_per_token",
            "minor_faults_per_token", "peak_rss_bytes", "stderr_tail")
    out = {k: r.get(k) for k in keep if k in r}
    tf = r.get("teacher_forced") or {}
    if tf.get("planned_F"):
        out["planned_F"] = tf["planned_F"]
    return out


def report(rows: list[dict]) -> dict:
    out = {}
    for n in sorted({r["context"] for r in rows}):
        by: dict[str, list[dict]] = {}
        for r in rows:
            if r["context"] == n and r.get("status") == "ok":
                by.setdefault(r["engine"], []).append(r)
        get = lambda e, k: statistics.median([r[k] for r in by[e]]) if by.get(e) else None
        o = {e: {"decode_tok_s": get(e, "decode_tok_s"), "peak_rss_gib": get(e, "peak_rss_bytes") / GiB,
                 **({"planned_F_gib": get(e, "planned_F") / GiB} if all(r.get("planned_F") for r in by[e]) else {})}
             for e in by}
        for mine, peer in (("maw", "llama"), ("maw", "llama-fa"), ("maw-q8", "llama-q8"), ("maw-q8", "llama"),
                           ("maw-q8", "maw")):
            if mine in by and peer in by:
                o[f"{mine}_x_{peer}"] = get(mine, "decode_tok_s") / get(peer, "decode_tok_s")
        for e in [e for e in by if "@" in e]:      # a limited row against the resident peers and, for
            mine, _, lim = e.partition("@")        # maw-q8, maw's row at the same limit
            for peer in ("llama", "llama-fa", "llama-q8", *([f"maw@{lim}"] if mine == "maw-q8" else [])):
                if peer in by:
                    o[f"{e}_x_{peer}"] = get(e, "decode_tok_s") / get(peer, "decode_tok_s")
        out[n] = o
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--contexts", default="4096,16384,32768")
    ap.add_argument("--limits", default="8", help="GiB for MawForge's limited rows ('' for none)")
    ap.add_argument("--engines", default="maw,llama,llama-fa",
                    help="resident engines: maw, llama (its default: flash attention off), llama-fa (on); "
                         "maw-q8, llama-q8: the KV cache in q8_0")
    ap.add_argument("--limit-engines", default="maw", help="MawForge engines run inside each of --limits")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--decode-tokens", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    a = ap.parse_args()
    gguf = synth_model(a.layers, "Q4_K_M", 1.0, 0.3)
    pack = pack_of(gguf)
    limits = [float(x) for x in a.limits.split(",") if x]
    engines = [e for e in a.engines.split(",") if e]
    bad = [e for e in engines + a.limit_engines.split(",") if e and e not in ENGINES]
    if bad or any(not e.startswith("maw") for e in a.limit_engines.split(",") if e):
        ap.error(f"unknown or unlimitable engines {bad or a.limit_engines}; choose from {', '.join(ENGINES)}")
    res = {"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "file": str(gguf),
           "rows": []}
    for rnd in range(a.rounds):
        for n in [int(x) for x in a.contexts.split(",")]:
            limited = [f"{e}@{lim:g}" for lim in limits for e in a.limit_engines.split(",") if e]
            order = engines + limited if rnd % 2 == 0 else engines[::-1] + limited[::-1]
            for engine in order:
                eng, _, lim = engine.partition("@")
                r = row(eng, gguf, pack, n, a.decode_tokens, a.warmup, float(lim) if lim else None)
                r.update(engine=engine, context=n, round=rnd)
                res["rows"].append(r)
                print(json.dumps(r), file=sys.stderr, flush=True)
    print(json.dumps(report(res["rows"]), indent=1))
    print(f"saved {save('long-context', res)}", file=sys.stderr)


if __name__ == "__main__":
    main()
