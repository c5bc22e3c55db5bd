"""Adapter for the peer engine BigMoeOnEdge (`bmoe-cli`, built by scripts/bmoe_build.py): run it
once as a child process on a GGUF and parse its end-of-run summary.

What bmoe-cli (BigMoeOnEdge 2d4f2b1) takes and prints, as read from its source and checked on a
2-layer synthetic Qwen3-30B-A3B-shape Q4_K_M file:
  - The prompt is text only (`-p`), tokenized with special tokens parsed and the model's BOS rule;
    there is no token-id or prompt-file input (`--session` takes JSON requests on stdin, also text).
  - Decoding is greedy by default; `--temp F` > 0 samples (top-k 40 -> top-p 0.95 -> temp -> dist,
    `--top-k`/`--top-p` to change) with `--seed N` (default random). Generation stops early at EOG.
  - `--cache-mb` must be 0 (no cache) or >= 1500 unless `--force-cache` is given; run_bmoe adds
    `--force-cache` for a smaller budget.
  - Without `--progress` it echoes the prompt and streams the text on stdout, then a blank line and
    the summary lines parsed here; llama.cpp's log (~350 lines) goes to stderr. Real output of
    `bmoe-cli -m tiny.gguf -p "The history of the transistor begins" -n 16 -t 2 --moe-stream
    --cache-mb 200 --force-cache --io-threads 4 --dense-weights anon` on `mawforge synth --layers 2
    --quant Q4_K_M` (a synthetic vocabulary, hence the [PAD…] text):

        The history of the transistor begins[PAD18389][PAD138676]…[PAD86881][PAD82859]

        generation: 16 tokens, 0.045 s/token (22.058 tok/s)
        compute: 77.1% CPU occupancy (0.0699 cpu-s/token over 2 threads), 0.00 major faults/token
        prefill: 22 tokens, 0.217 s (101.6 tok/s) | model load 0.643 s | TTFT 0.859 s
        moe-stream: read 525.5 MiB (32.85 MiB/token), decode 0.045 s/token (compute 0.016 + cache mgmt 0.002
          + flash I/O 0.027 s/token, 1236 MiB/s)   [one line, folded here]
        moe-cache: 18.7% hit, resident 197.3 MiB
        moe-cache: 210 evictions, 80 re-reads (5.0/token) — bytes the cache had already paid for once

  `generation:` tok/s is decode time only (the bracket around llama_decode; sampling and
  detokenizing between tokens excluded). `prefill:` is the prompt pass. `moe-stream: read` counts
  the expert bytes read during generation only (prefill excluded); `moe-cache: % hit` is
  cumulative over the run, prefill lookups included, and absent without a cache.

    python benchmarks/bmoe.py MODEL [-p TEXT] [-n 16] [--cache-mb 0] [--n-expert-used K]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Sequence

CACHE = Path(os.environ.get("MAWFORGE_CACHE", Path.home() / ".cache" / "mawforge"))
CACHE_MIN_MB = 1500         # bmoe's MoeStreamConfig::cache_min_mb: below it needs --force-cache
_NUM = r"([0-9]+(?:\.[0-9]+)?)"
_GEN = re.compile(rf"^generation: (\d+) tokens, {_NUM} s/token \({_NUM} tok/s\)$", re.M)
_PREFILL = re.compile(rf"^prefill: (\d+) tokens, {_NUM} s \({_NUM} tok/s\) \| model load {_NUM} s", re.M)
_STREAM = re.compile(rf"^moe-stream: read {_NUM} MiB \({_NUM} MiB/token\)", re.M)
_HIT = re.compile(rf"^moe-cache: {_NUM}% hit, resident {_NUM} MiB", re.M)


class BmoeError(RuntimeError):
    pass


def bmoe_binary() -> Path | None:
    """$BMOE_BIN, else the binary scripts/bmoe_build.py puts in $MAWFORGE_CACHE/bmoe/bin."""
    for p in (os.environ.get("BMOE_BIN"), CACHE / "bmoe" / "bin" / "bmoe-cli", shutil.which("bmoe-cli")):
        if p and Path(p).is_file() and os.access(p, os.X_OK):
            return Path(p)
    return None


def _last(rx: re.Pattern, text: str) -> re.Match | None:
    found = list(rx.finditer(text))   # the summary follows the generated text: take the last
    return found[-1] if found else None


def parse(output: str, need_stream: bool = True, need_hit: bool = False) -> dict:
    """The summary lines of one bmoe-cli run (stdout) as numbers; BmoeError if one is missing."""
    gen, pre = _last(_GEN, output), _last(_PREFILL, output)
    stream, hit = _last(_STREAM, output), _last(_HIT, output)
    missing = [n for n, m, need in (("generation:", gen, True), ("prefill:", pre, True),
                                    ("moe-stream:", stream, need_stream), ("moe-cache:", hit, need_hit))
               if need and m is None]
    if missing:
        raise BmoeError(f"bmoe-cli output has no {', '.join(missing)} line; tail:\n{output[-2000:]}")
    n_gen = int(gen[1])
    r = {"decode_tok_s": float(gen[3]), "decode_s_per_token": float(gen[2]), "n_generated": n_gen,
         "prompt_tok_s": float(pre[3]), "n_prompt": int(pre[1]), "prefill_s": float(pre[2]),
         "load_s": float(pre[4]), "hit_rate": float(hit[1]) / 100 if hit else None,
         "cache_resident_mib": float(hit[2]) if hit else None,
         "read_bytes_per_token": None, "read_mib": None}
    if stream:
        r["read_mib"] = float(stream[1])
        # from the total (0.1 MiB resolution), not the printed per-token figure (0.01 MiB)
        r["read_bytes_per_token"] = float(stream[1]) * 2**20 / n_gen if n_gen else None
    return r


def run_bmoe(model: str | Path, prompt_text: str, n_predict: int, cache_mb: int, io_threads: int = 4,
             threads: int = 2, n_expert_used: int | None = None, seed: int = 0, temp: float = 0.0,
             extra: Sequence[str] = (), timeout: float = 3600, binary: Path | None = None,
             wrap=None) -> dict:
    """One streamed (`--moe-stream --dense-weights anon`) bmoe-cli run; greedy unless temp > 0.
    Returns parse()'s numbers plus cmd and raw_tail (the last 12 stdout lines: the summary; the
    ~350-line llama.cpp log on stderr is shown only when the run fails). wrap(cmd) -> the command
    run (e.g. a cgroup's MemoryCgroup.wrap); cmd is recorded unwrapped."""
    binary = binary or bmoe_binary()
    if binary is None:
        raise BmoeError("no bmoe-cli: run `python scripts/bmoe_build.py` (or set BMOE_BIN)")
    cmd = [str(binary), "-m", str(model), "-p", prompt_text, "-n", str(n_predict), "-t", str(threads),
           "--moe-stream", "--cache-mb", str(cache_mb), "--io-threads", str(io_threads),
           "--dense-weights", "anon", "--temp", str(temp), "--seed", str(seed)]
    if 0 < cache_mb < CACHE_MIN_MB:
        cmd.append("--force-cache")
    if n_expert_used is not None:
        cmd += ["--n-expert-used", str(n_expert_used)]
    cmd += list(extra)
    p = subprocess.run(wrap(cmd) if wrap else cmd, capture_output=True, text=True, timeout=timeout,
                       errors="replace")
    if p.returncode != 0:
        tail = "\n".join((p.stderr + p.stdout).splitlines()[-40:])
        raise BmoeError(f"bmoe-cli exited {p.returncode}: {' '.join(cmd)}\n{tail}")
    r = parse(p.stdout, need_stream=True, need_hit=cache_mb > 0)
    r.update(cmd=cmd, raw_tail="\n".join(p.stdout.splitlines()[-12:]))
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description="Run bmoe-cli once and print its parsed summary as JSON.")
    ap.add_argument("model")
    ap.add_argument("-p", "--prompt", default="The history of the transistor begins")
    ap.add_argument("-n", "--n-predict", type=int, default=16)
    ap.add_argument("--cache-mb", type=int, default=0)
    ap.add_argument("--io-threads", type=int, default=4)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--n-expert-used", type=int)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--temp", type=float, default=0.0)
    a, extra = ap.parse_known_args()
    r = run_bmoe(a.model, a.prompt, a.n_predict, a.cache_mb, a.io_threads, a.threads, a.n_expert_used,
                 a.seed, a.temp, extra)
    print(json.dumps(r, indent=1))


if __name__ == "__main__":
    main()
