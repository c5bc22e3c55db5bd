"""Speculative vs plain decoding on a split pack, at several expert-cache points.

    python benchmarks/speculative.py                    # smoke: tiny qwen3_moe fixtures in a temp dir
    python benchmarks/speculative.py --smoke synth      # smoke: tiny `mawforge synth` files
                                                        # (4-layer target, 2-layer draft)

Full size (about 40 runs of one target load each; budget about an hour on 2 quiet cores): the
24-layer shape-true target and a 2-layer synth draft. Both come from `mawforge synth` with the
same seed and vocabulary, so they share the tokenizer, the embeddings, the output head and
layers 0-1's attention weights; the draft's down projections and routers differ (scaled and
calibrated for 2 layers). Pack the draft once:

    mawforge pack /work/bt/work/bench/qwen3moe-L2-Q4_K_M-skew0-stick0-s0.gguf \
        -o /work/bt/work/bench/qwen3moe-L2-Q4_K_M-skew0-stick0-s0.exact.pack --layout exact
    python benchmarks/speculative.py \
        --pack /work/bt/work/bench/qwen3moe-L24-Q4_K_M-skew0-stick0-s0.exact.pack \
        --draft-pack /work/bt/work/bench/qwen3moe-L2-Q4_K_M-skew0-stick0-s0.exact.pack \
        --cache min 10 25 50 100 --modes ngram draft auto --k 4 --decode-tokens 64 \
        --context 1024 --threads 2 --warmup-tokens 8 --json-out work/bench/speculative-L24.jsonl

For each cache point (percent of all routed expert bytes, or 'min': one layer's top-k working
set) and prompt (a repetitive code edit, a non-repetitive text) it runs plain decoding once,
then each speculative mode on a fresh runtime, all greedy (so every mode must emit the plain
tokens; a mismatch is reported as same=NO), and prints per row: acceptance, verify width,
experts touched per layer by a verify step vs a single-token step, decode tok/s and its ratio
against plain in the same run, materialized bytes of the request and their ratio against the
plain request, the decode-only ratio against plain decoding replayed on a copy of the cache
(`dec x`), the extra bytes and evictions speculation caused, and the draft's planned L. The
plain row gives the fraction of distinct tokens in its output: random-weight synthetic models
tend to repeat under greedy decoding, which makes any drafter look good; read acceptance
against it. Figures are ratios against plain runs measured in the same process, never pass/fail.
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
from mawforge.speculative.decode import SpecOptions, Speculator  # noqa: E402
from mawforge.plan import PackFacts  # noqa: E402

CODE_EDIT = ("Rename `total` to `acc` in this function and return the same code.\n\n"
             "def total_of(items):\n    total = 0\n    for item in items:\n        total = total + item.price\n"
             "    return total\n\n"
             "def acc_of(items):\n    acc = 0\n    for item in items:\n        acc = acc + item.price\n"
             "    return acc\n\ndef total_of(items):\n    total = 0\n    for item in items:\n")
PROSE = ("Weather reports from the northern coast describe a cold front arriving overnight, with gusts "
         "along the ridge and scattered showers inland. Farmers expect a late harvest; the ferry schedule")
PROMPTS = {"code-edit": CODE_EDIT, "prose": PROSE}
MiB = 2**20


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


def tiny_synth_packs(root: Path) -> tuple[Path, Path]:
    """The full-size recipe at tiny dimensions: `mawforge synth` Q4_K_M, a 4-layer target and a
    2-layer draft with the same seed and vocabulary (so the same tokenizer), packed exact."""
    from mawforge.synth import synth
    from mawforge.pack.packer import pack
    dims = dict(hidden=256, n_head=4, n_head_kv=2, head_dim=64, n_expert=16, n_expert_used=4, expert_ff=256)
    out = []
    for layers in (4, 2):
        p = root / f"synth-L{layers}.pack"
        if not p.exists():
            g = synth(root / f"synth-L{layers}.gguf", layers, vocab=2000, report=False, progress=False, **dims)
            pack(g, p, layout="exact", progress=False)
        out.append(p)
    return out[0], out[1]


def runtime(pack: Path, cache: str, context: int, threads: int | None) -> Runtime:
    if cache == "min":
        gib = PackFacts.from_pack(pack).min_cache_bytes / 2**30
        return Runtime(pack, RuntimeOptions(context=context, threads=threads, expert_cache_gib=gib))
    return Runtime(pack, RuntimeOptions(context=context, expert_cache_percent=float(cache), threads=threads))


def one(pack: Path, cache: str, prompt: str, mode: str, a: argparse.Namespace, max_tokens: int | None = None):
    """One greedy request on a fresh runtime (a cold expert cache): (tokens, telemetry)."""
    rt = runtime(pack, cache, a.context, a.threads)
    sp = None
    try:
        if mode != "plain":
            sp = Speculator(rt, SpecOptions(mode=mode, k=a.k, draft_pack=a.draft_pack,
                                            draft_cache_percent=a.draft_cache_percent))
        ids = rt.tokenizer.encode(prompt)
        params = SamplingParams(max_tokens=max_tokens or a.decode_tokens, ignore_eos=True)
        ev = list(generate(rt, ids, params, speculative=sp))
        return [e.token for e in ev], ev[-1].telemetry
    finally:
        if sp is not None:
            sp.close()
        rt.close()


HDR = (f"{'cache%':>7} {'prompt':>9} {'mode':>10} {'same':>4} {'distinct':>8} {'accepted':>9} {'width':>5} "
       f"{'exp/L':>9} {'tok/s':>7} {'x':>5} {'MiB':>8} {'x':>5} {'dec x':>5} {'extraMiB':>8} {'+evict':>6} "
       f"{'draftMiB':>8}")


def plain_row(pct: float, pname: str, toks: list[int], tp) -> tuple[str, dict]:
    distinct = len(set(toks)) / max(len(toks), 1)
    line = (f"{pct:7.2f} {pname:>9} {'plain':>10} {'':>4} {distinct:8.2f} {'':>9} {'':>5} {'':>9} "
            f"{tp.decode_tok_s:7.2f} {1.0:5.2f} {tp.materialized_bytes / MiB:8.1f} {1.0:5.2f}")
    return line, {"mode": "plain", "distinct_fraction": distinct, "decode_tok_s": tp.decode_tok_s,
                  "materialized_bytes": tp.materialized_bytes}


def spec_row(pct: float, pname: str, mode: str, toks: list[int], t, base: list[int], tp) -> tuple[str, dict]:
    s = t.speculative
    label = mode if mode != "auto" else f"auto:{s['drafter']}"
    row = {"mode": label, "identical": toks == base, "acceptance": s["acceptance_rate"],
           "decode_tok_s": t.decode_tok_s, "plain_decode_tok_s": tp.decode_tok_s,
           "tok_s_ratio": t.decode_tok_s / max(tp.decode_tok_s, 1e-9),
           "materialized_bytes": t.materialized_bytes, "plain_materialized_bytes": tp.materialized_bytes,
           "materialized_ratio": t.materialized_bytes / max(tp.materialized_bytes, 1),
           "decode_materialized_ratio": s["decode_materialized_bytes"] / max(s["plain_materialized_bytes"], 1),
           "draft_planned_bytes": s["draft"].get("planned_bytes", 0)}
    line = (f"{pct:7.2f} {pname:>9} {label:>10} {'yes' if row['identical'] else 'NO':>4} {'':>8} "
            f"{s['accepted']:>4}/{s['drafted']:<4} {s['verify_width']:5.2f} "
            f"{s['union_experts_per_layer']:4.1f}/{s['single_token_experts_per_layer']:<4.1f} "
            f"{t.decode_tok_s:7.2f} {row['tok_s_ratio']:5.2f} {t.materialized_bytes / MiB:8.1f} "
            f"{row['materialized_ratio']:5.2f} {row['decode_materialized_ratio']:5.2f} "
            f"{s['extra_materialized_bytes'] / MiB:8.1f} {s['extra_evictions']:>+6d} "
            f"{row['draft_planned_bytes'] / MiB:8.1f}")
    return line, row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pack", help="target pack (default: build the --smoke packs in a temp dir)")
    ap.add_argument("--draft-pack", help="a smaller pack with the same tokenizer (mode 'draft' needs it)")
    ap.add_argument("--draft-cache-percent", type=float, default=100.0)
    ap.add_argument("--smoke", choices=("fixtures", "synth"), default="fixtures",
                    help="without --pack: tiny qwen3_moe fixtures (F32 target, Q8_0 draft) or tiny synth files")
    ap.add_argument("--cache", nargs="+", default=["min", "25", "50", "100"],
                    help="cache points: percents of all routed expert bytes, or 'min'")
    ap.add_argument("--modes", nargs="+", default=["ngram", "draft", "auto"])
    ap.add_argument("--prompts", nargs="+", default=list(PROMPTS), choices=list(PROMPTS))
    ap.add_argument("--k", type=int, default=4, help="draft horizon")
    ap.add_argument("--decode-tokens", "--max-tokens", dest="decode_tokens", type=int, default=48,
                    help="tokens generated per request")
    ap.add_argument("--warmup-tokens", type=int, default=8, help="an untimed plain request first (0: none)")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1, help="torch and native compute threads")
    ap.add_argument("--json-out")
    a = ap.parse_args(argv)
    tmp = None
    if a.pack is None:
        tmp = tempfile.TemporaryDirectory(prefix="mawforge-spec-bench-")
        pack, draft = (tiny_packs if a.smoke == "fixtures" else tiny_synth_packs)(Path(tmp.name))
        a.pack, a.draft_pack = str(pack), a.draft_pack or str(draft)
    modes = [m for m in a.modes if m != "draft" or a.draft_pack]
    facts = PackFacts.from_pack(a.pack)
    print(f"target {a.pack} ({facts.n_layers} layers, {facts.expert_bytes / MiB:.0f} MiB experts)")
    print(f"draft  {a.draft_pack or '-'} | k={a.k}, {a.decode_tokens} tokens, greedy, context {a.context}, "
          f"{a.threads} thread(s); x = against plain decoding in this run")
    if a.warmup_tokens > 0:
        one(Path(a.pack), a.cache[0], PROMPTS[a.prompts[0]], "plain", a, a.warmup_tokens)
    rows = []
    print(HDR)
    print("-" * len(HDR))
    for cache in a.cache:
        for pname in a.prompts:
            base, tp = one(Path(a.pack), cache, PROMPTS[pname], "plain", a)
            pct = 100.0 * tp.expert_cache_bytes / facts.expert_bytes
            meta = {"cache": cache, "cache_percent": pct, "prompt": pname}
            line, row = plain_row(pct, pname, base, tp)
            print(line, flush=True)
            rows.append({**meta, **row, "telemetry": tp.to_dict()})
            for mode in modes:
                toks, t = one(Path(a.pack), cache, PROMPTS[pname], mode, a)
                line, row = spec_row(pct, pname, mode, toks, t, base, tp)
                print(line, flush=True)
                rows.append({**meta, **row, "telemetry": t.to_dict()})
    if a.json_out:
        Path(a.json_out).parent.mkdir(parents=True, exist_ok=True)
        with open(a.json_out, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
