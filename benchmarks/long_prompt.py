"""Long prompts on the full-size file (issue 27, items 2, 3 and 5): prefill of a 512- and a
2,048-token prompt and decode right after it, MawForge against llama.cpp in the same run, and
MawForge inside a memory limit against its own resident run.

Each row is one `benchmarks/fullsize.py worker` child on a dropped page cache: a random prompt of
--prompts tokens (TTFT = its prefill), then --decode-tokens teacher-forced one-token steps at the
positions after it (the first --warmup not timed). MawForge resident runs with the whole expert
cache preloaded; llama.cpp with repack off (`llama`) and, where it fits, with its default load
(`llama-default`: weights repacked for its CPU kernels, ~24.7 GB resident); MawForge under a
limit with --memory-budget-gib 0.92 x limit inside a cgroup of the limit. Engines alternate
within each round.

    python benchmarks/long_prompt.py [--prompts 512,2048] [--limits 8] [--rounds 1] [--decode-tokens 12]
                                     [--engines maw,llama,llama-default]

Reported per prompt length: prefill tok/s of each engine and MawForge / llama.cpp (target >= 1.0),
decode tok/s after the prompt and the ratio, MawForge's TTFT inside the limit / its resident TTFT
(target <= 1.5), and its prefill bytes read / the bytes of the experts the prompt routes to
(target <= 1.1).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import machine, pack_of, save, synth_model, worker_row  # noqa: E402

FULLSIZE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fullsize.py")
GiB = 2**30


def row(engine: str, gguf, pack, prompt: int, decode: int, warmup: int, limit: float | None) -> dict:
    args = [engine, "--prompt-tokens", str(prompt), "--decode-tokens", str(decode), "--warmup", str(warmup),
            "--classes", ""]
    if engine in ("llama", "llama-default"):
        args = ["llama", *args[1:], "--model", str(gguf)] + (["--no-repack"] if engine == "llama" else [])
    elif limit:
        args += ["--pack", str(pack), "--budget-gib", f"{0.92 * limit:.3f}"]
    else:
        args += ["--pack", str(pack), "--cache-percent", "100", "--preload"]
    r = worker_row(FULLSIZE, args, int(limit * GiB) if limit else None, timeout=7200)
    keep = ("status", "load_s", "ttft_s", "prefill_tok_s", "prefill_read_bytes", "prefill_needed_bytes",
            "decode_tok_s", "read_bytes_per_token", "peak_rss_bytes", "stderr_tail")
    return {k: r.get(k) for k in keep if k in r}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--prompts", default="512,2048")
    ap.add_argument("--limits", default="8", help="GiB for MawForge's limited rows ('' for none)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--decode-tokens", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--engines", default="maw,llama",
                    help="of maw, llama (repack off), llama-default (its default load)")
    a = ap.parse_args()
    gguf = synth_model(a.layers, "Q4_K_M", 1.0, 0.3)
    pack = pack_of(gguf)
    limits = [float(x) for x in a.limits.split(",") if x]
    res = {"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "file": str(gguf),
           "rows": []}
    for rnd in range(a.rounds):
        for n in [int(x) for x in a.prompts.split(",")]:
            engines = [e for e in a.engines.split(",") if e]
            order = engines if rnd % 2 == 0 else engines[::-1]
            for engine in order + [f"maw@{lim:g}" for lim in limits]:
                eng, _, lim = engine.partition("@")
                r = row(eng, gguf, pack, n, a.decode_tokens, a.warmup, float(lim) if lim else None)
                r.update(engine=engine, prompt_tokens=n, round=rnd)
                res["rows"].append(r)
                print(json.dumps(r), file=sys.stderr, flush=True)
    print(json.dumps(report(res["rows"]), indent=1))
    print(f"saved {save('long-prompt', res)}", file=sys.stderr)


def report(rows: list[dict]) -> dict:
    med = lambda xs: statistics.median(xs) if xs else None
    out = {}
    for n in sorted({r["prompt_tokens"] for r in rows}):
        by = {}
        for r in rows:
            if r["prompt_tokens"] == n and r.get("status") == "ok":
                by.setdefault(r["engine"], []).append(r)
        get = lambda e, k: med([r[k] for r in by.get(e, []) if r.get(k)])
        o = {e: {k: get(e, k) for k in ("prefill_tok_s", "ttft_s", "decode_tok_s")} for e in by}
        for peer, tag in (("llama", "llama_cpp"), ("llama-default", "llama_cpp_default_load")):
            if "maw" in by and peer in by:
                o[f"prefill_x_{tag}"] = get("maw", "prefill_tok_s") / get(peer, "prefill_tok_s")
                o[f"decode_x_{tag}"] = get("maw", "decode_tok_s") / get(peer, "decode_tok_s")
        for e in [e for e in by if e.startswith("maw@")]:
            if "maw" in by:
                o[f"{e} ttft_x_resident"] = get(e, "ttft_s") / get("maw", "ttft_s")
            needed = get(e, "prefill_needed_bytes")
            if needed:
                o[f"{e} prefill_read_x_needed"] = get(e, "prefill_read_bytes") / needed
        out[n] = o
    return out


if __name__ == "__main__":
    main()
