"""What a JSON schema costs per token: greedy decode of the full-size file with and without a
`response_format` json_schema (llguidance's mask on every step), in one process, alternating,
with the whole model in memory (the fastest decode, so the mask's share is at its largest).

    python benchmarks/structured.py [--layers 48] [--tokens 32] [--rounds 3]

Each round runs the plain and the constrained request (order swapped every round) on the same
prompt with the prompt cache off; decode tok/s is the telemetry's (first token excluded). The
schema's one string field keeps the output going to max_tokens, so both runs decode as many
tokens. The first constrained call (building the vocabulary's token table) is not timed.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(__file__))
from common import machine, pack_of, save, synth_model  # noqa: E402

SCHEMA = {"type": "json_schema", "json_schema": {"name": "note", "strict": True, "schema": {
    "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"],
    "additionalProperties": False}}}
PROMPT = "Write a short note about expert caches as JSON:"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    import mawforge
    pack = pack_of(synth_model(a.layers, "Q4_K_M", skew=1.0, stickiness=0.3))
    rows = {"plain": [], "json_schema": []}
    with mawforge.load(pack, context=1024, expert_cache_percent=100, prompt_cache_gib=0,
                       threads=a.threads) as m:
        m.runtime.cache.preload()
        m.complete(PROMPT, max_tokens=2, response_format=SCHEMA)            # token table, untimed
        for r in range(a.rounds):
            order = ("plain", "json_schema") if r % 2 == 0 else ("json_schema", "plain")
            for name in order:
                fmt = SCHEMA if name == "json_schema" else None
                out = m.complete(PROMPT, max_tokens=a.tokens, ignore_eos=True, response_format=fmt)
                t = out.telemetry
                rows[name].append({"decode_tok_s": t.decode_tok_s, "tokens": len(out.tokens),
                                   "finish": out.finish_reason, "ttft_s": t.ttft_s})
                print(name, rows[name][-1], flush=True)
    med = {k: statistics.median(x["decode_tok_s"] for x in v) for k, v in rows.items()}
    print(f"\n# structured outputs' cost, {machine()}, {a.layers} layers resident, {a.threads} threads")
    for k, v in rows.items():
        print(f"{k:12s} decode tok/s " + ", ".join(f"{x['decode_tok_s']:.2f}" for x in v) + f" (median {med[k]:.2f})")
    print(f"json_schema / plain: {med['json_schema'] / med['plain']:.3f}")
    print(f"saved {save('structured', {'machine': machine(), 'rows': rows, 'medians': med})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
