"""The seed paper's serving shape (issue 27, item 3): the full-size file planned and served with an
18 GiB target and a 32K context, the three-turn chat of benchmarks/conversation.py sent to it
through the official `openai` client, each turn streamed and timed at the client.

    python benchmarks/seed_shape.py [--budget-gib 18] [--context 32768] [--max-tokens 32] [--limit-gib 19.6]

Prints `mawforge plan` for that configuration (C, E, K, P, O, F), then per turn the prompt and
cached tokens, TTFT and decode tok/s, and the server's peak RSS against F. The server runs inside
a cgroup v1 memory limit of --limit-gib (default: the budget / 0.92, as the other benchmarks leave
8% of a limit to the page cache), on a dropped page cache.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import conv_engines as E  # noqa: E402
from common import PY, WORK, machine, pack_of, save, synth_model  # noqa: E402
from conversation import chat_workload, qwen3_template  # noqa: E402

GiB = 2**30


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--budget-gib", type=float, default=18.0)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--limit-gib", type=float, help="the cgroup's limit (default budget / 0.92)")
    a = ap.parse_args()
    gguf = synth_model(a.layers, "Q4_K_M", skew=1.0, stickiness=0.3)
    pack = pack_of(gguf)
    conf = ["--pack", str(pack), "--memory-budget-gib", str(a.budget_gib), "--context", str(a.context)]
    plan = json.loads(subprocess.run([PY, "-m", "mawforge.cli", "plan", *conf, "--json"], capture_output=True,
                                     text=True, check=True).stdout)
    print(subprocess.run([PY, "-m", "mawforge.cli", "plan", *conf], capture_output=True, text=True).stdout)
    template = qwen3_template().resolve()
    cmd = [PY, "-m", "mawforge.cli", "serve", *conf, "--port", "0", "--model-id", E.MODEL_ID,
           "--threads", os.environ.get("MAWFORGE_BENCH_THREADS", "2"), "--chat-template-file", str(template)]
    limit = a.limit_gib or a.budget_gib / 0.92
    WORK.mkdir(parents=True, exist_ok=True)
    server = E.Server(cmd, WORK / "seed-shape-serve.log", int(limit * GiB))
    row = E.serve_turns(server, E.maw_url, chat_workload(1.0, 0), a.max_tokens, 1800, 1200)
    row.update(plan={k: plan.get(k) for k in ("C", "E", "K", "P", "O", "F", "context", "cache_percent", "feasible")},
               limit_gib=limit, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), machine=machine())
    print(f"# seed shape: {a.budget_gib:g} GiB budget, context {a.context}, cgroup {limit:.2f} GiB, {machine()}")
    for i, t in enumerate(row["turns"], 1):
        print(f"turn {i}: prompt {t.get('prompt_tokens')} (cached {t.get('cached_tokens')}), "
              f"TTFT {t.get('ttft_s', float('nan')):.1f} s, decode {t.get('decode_tok_s') or float('nan'):.2f} tok/s")
    peak = row["cgroup"].get("peak_rss_bytes") or 0
    print(f"status {row['status']}; peak RSS {peak / GiB:.2f} GiB, planned F {plan['F'] / GiB:.2f} GiB "
          f"({'within' if peak <= plan['F'] else 'ABOVE'} F)")
    print(f"saved {save('seed-shape', row)}")
    return 0 if row["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
