"""Speculative vs plain decoding on a split pack, at several expert-cache points.

    python benchmarks/speculative.py                                  # tiny fixtures (built into a temp dir)
    python benchmarks/speculative.py --pack PACK [--draft-pack SMALL] --cache min 15 25 50 100 \
        --max-tokens 96 --modes ngram draft auto --json-out spec.jsonl

For each cache point and prompt (a repetitive code edit, a non-repetitive text) it runs plain
decoding once, then each speculative mode on a fresh runtime, all greedy (so every mode must
emit the plain tokens; a mismatch is reported), and prints per row: acceptance, verify width,
experts touched per layer by a verify step vs a single-token step, decode tok/s ratio against
plain in the same run, materialized bytes ratio (measured: speculative request vs the plain
request), the counterfactual extra bytes and extra evictions speculation caused, draft memory.
Figures are ratios against the plain run measured in the same process; never a pass/fail.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mawforge.engine.generate import generate  # noqa: E402
from mawforge.engine.runtime import Runtime, RuntimeOptions  # noqa: E402
from mawforge.engine.sampling import SamplingParams  # noqa: E402
from mawforge.engine.speculative import SpecOptions, Speculator  # noqa: E402
from mawforge.plan import PackFacts  # noqa: E402

CODE_EDIT = ("Rename `total` to `acc` in this function and return the same code.\n\n"
             "def total_of(items):\n    total = 0\n    for item in items:\n        total = total + item.price\n"
             "    return total\n\n"
             "def acc_of(items):\n    acc = 0\n    for item in items:\n        acc = acc + item.price\n"
             "    return acc\n\ndef total_of(items):\n    total = 0\n    for item in items:\n")
PROSE = ("Weather reports from the northern coast describe a cold front arriving overnight, with gusts "
         "along the ridge and scattered showers inland. Farmers expect a late harvest; the ferry schedule")
PROMPTS = {"code-edit": CODE_EDIT, "prose": PROSE}


def tiny_packs(root: Path) -> tuple[Path, Path]:
    """Target qwen3_moe F32; draft: the same weights at Q8_0 (a stand-in with high acceptance)."""
    from mawforge.fixtures.build import build_fixtures
    from mawforge.pack.packer import pack
    fx = build_fixtures(root / "fixtures", archs=("qwen3_moe",), ftypes=("F32", "Q8_0"))
    out = []
    for ft in ("F32", "Q8_0"):
        p = root / f"qwen3_moe-{ft}"
        if not p.exists():
            pack(fx["qwen3_moe"]["gguf"][ft], p, progress=False)
        out.append(p)
    return out[0], out[1]


def runtime(pack: Path, cache: str, context: int, threads: int | None) -> Runtime:
    if cache == "min":
        return Runtime(pack, RuntimeOptions(context=context, threads=threads,
                                            expert_cache_gib=PackFacts.from_pack(pack).min_cache_bytes / 2**30))
    return Runtime(pack, RuntimeOptions(context=context, expert_cache_percent=float(cache), threads=threads))


def one(pack: Path, cache: str, prompt: str, mode: str, a: argparse.Namespace) -> tuple[list[int], object]:
    rt = runtime(pack, cache, a.context, a.threads)
    sp = None
    try:
        if mode != "plain":
            sp = Speculator(rt, SpecOptions(mode=mode, k=a.k, draft_pack=a.draft_pack))
        ids = rt.tokenizer.encode(prompt)
        ev = list(generate(rt, ids, SamplingParams(max_tokens=a.max_tokens, ignore_eos=True), speculative=sp))
        return [e.token for e in ev], ev[-1].telemetry
    finally:
        if sp is not None:
            sp.close()
        rt.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pack")
    ap.add_argument("--draft-pack")
    ap.add_argument("--cache", nargs="+", default=["min", "25", "50", "100"], help="'min' or percents")
    ap.add_argument("--modes", nargs="+", default=["ngram", "draft", "auto"])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json-out")
    a = ap.parse_args(argv)
    tmp = None
    if a.pack is None:
        tmp = tempfile.TemporaryDirectory(prefix="mawforge-spec-bench-")
        pack, draft = tiny_packs(Path(tmp.name))
        a.pack, a.draft_pack = str(pack), a.draft_pack or str(draft)
    modes = [m for m in a.modes if m != "draft" or a.draft_pack]
    rows = []
    hdr = (f"{'cache':>5} {'prompt':>9} {'mode':>10} {'same':>4} {'acc':>7} {'width':>5} {'exp/L':>9} "
           f"{'tok/s':>7} {'xplain':>6} {'MiB':>7} {'xplain':>6} {'extraMiB':>8} {'+evict':>6} {'draftMiB':>8}")
    print(hdr)
    print("-" * len(hdr))
    for cache in a.cache:
        for pname, prompt in PROMPTS.items():
            base, tp = one(Path(a.pack), cache, prompt, "plain", a)
            print(f"{cache:>5} {pname:>9} {'plain':>10} {'':>4} {'':>7} {'':>5} {'':>9} {tp.decode_tok_s:7.1f} "
                  f"{1.0:6.2f} {tp.materialized_bytes / 2**20:7.1f} {1.0:6.2f}")
            rows.append({"cache": cache, "prompt": pname, "mode": "plain", "telemetry": tp.to_dict()})
            for mode in modes:
                toks, t = one(Path(a.pack), cache, prompt, mode, a)
                s = t.speculative
                d = s["draft"]
                draft_mib = (d.get("resident_common_bytes", 0) + d.get("expert_cache_bytes", 0)
                             + d.get("kv_cache_bytes", 0)) / 2**20
                label = mode if mode != "auto" else f"auto:{s['drafter']}"
                row = {"cache": cache, "prompt": pname, "mode": label, "identical": toks == base,
                       "acceptance": s["acceptance_rate"], "tok_s_ratio": t.decode_tok_s / max(tp.decode_tok_s, 1e-9),
                       "materialized_ratio": t.materialized_bytes / max(tp.materialized_bytes, 1),
                       "telemetry": t.to_dict()}
                rows.append(row)
                print(f"{cache:>5} {pname:>9} {label:>10} {'yes' if row['identical'] else 'NO':>4} "
                      f"{s['accepted']:>3}/{s['drafted']:<3} {s['verify_width']:5.2f} "
                      f"{s['union_experts_per_layer']:4.1f}/{s['single_token_experts_per_layer']:<4.1f} "
                      f"{t.decode_tok_s:7.1f} {row['tok_s_ratio']:6.2f} {t.materialized_bytes / 2**20:7.1f} "
                      f"{row['materialized_ratio']:6.2f} {s['extra_materialized_bytes'] / 2**20:8.1f} "
                      f"{s['extra_evictions']:>+6d} {draft_mib:8.1f}")
    if a.json_out:
        with open(a.json_out, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
