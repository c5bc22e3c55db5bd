"""The price of the lossy miss policies (`--miss-policy substitute|skip[:W]`, models/miss_policy.py):
each setting's decode against exact decoding of the same tokens at the same expert-cache size, in
the same run. Decode is teacher-forced (every setting sees the same tokens), prefill exact.

    python benchmarks/miss_policy.py demo [--cache-percent 25,50] [--windows 8] [--record]
    python benchmarks/miss_policy.py fullsize --model GGUF [--limit-gib 8] [--decode 96] [--record]

`demo`: the shipped trained model (mawforge/demo/, 16 experts, top-2) on held-out text of its
corpus (documents it never trained on; scripts/demo_corpus.py builds them from the Debian packages
bible-kjv and python3.11-doc), prefetch off so the cache holds what the routing alone put there:
per setting the mean KL divergence KL(exact || setting) in nats a token, top-1 agreement with
exact, the perplexity of the text, the share of routed experts substituted or skipped and the
expert bytes read a token. `fullsize`: a shape-true file (e.g. `synth --routing real`, 48
layers) inside a cgroup v1 memory limit, teacher-forced random ids, default prefetch: decode
tok/s, hit rate, bytes read a token and KL / top-1 against exact; random weights make
perplexity meaningless there, so it is left out.

Each setting is one child process (`miss_policy.py worker ...`) on a dropped page cache; its
log-probabilities go to a float16 file under work/bench that the parent compares.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import finish_record, ROOT, WORK, commit, cpu_kind, machine, pack_of, quiet, worker_row  # noqa: E402

GiB = 2**30
SETTINGS = ("exact", "substitute:0.1", "substitute:0.2", "substitute:1", "skip:0.1", "skip:0.2", "skip:1")
DEMO_PACK = ROOT / "mawforge" / "demo" / "mawforge-demo-qwen3moe-Q4_K_M.exact.pack"


# ---- the worker (one setting, one child process) ------------------------------------------------
def work(a) -> dict:
    import torch
    from mawforge.engine.options import RuntimeOptions
    from mawforge.engine.runtime import Runtime
    from mawforge.plan import Budget
    budget = Budget(int(a.budget_gib * GiB), "--budget-gib") if a.budget_gib else None
    opts = RuntimeOptions(context=a.context, budget=budget, default_budget=False,
                          expert_cache_percent=a.cache_percent, miss_policy=a.policy, threads=a.threads,
                          prefetch=a.prefetch,
                          stream_embeddings=bool(a.budget_gib))
    rt = Runtime(a.pack, opts)
    windows = np.load(a.tokens)                                                   # [W, P + D]
    lps, times = [], []
    counted = ("hits", "misses", "materialized_bytes")
    dec = dict.fromkeys(counted + ("read_bytes",), 0)             # decode steps only; prefill is exact
    for row in windows.tolist():
        rt.reset()
        rt.forward(row[:a.prompt_tokens])
        s0, r0 = rt.cache.stats(), rt.store.bytes_read
        for i, tok in enumerate(row[a.prompt_tokens:]):
            t0 = time.perf_counter()
            logits = rt.forward([tok], kind="decode")[-1].float()
            if i >= 2:                                # a window's first steps follow its prompt's reads
                times.append(time.perf_counter() - t0)
            lps.append(torch.log_softmax(logits, -1).to(torch.float16).numpy())
        s1 = rt.cache.stats()
        for k in counted:
            dec[k] += s1[k] - s0[k]
        dec["read_bytes"] += rt.store.bytes_read - r0
    np.save(a.logits_out, np.stack(lps))
    n = len(lps)
    return {"setting": a.policy, "decode_tokens": n, "decode_tok_s": len(times) / sum(times), **dec,
            **rt.model.experts.miss.counts, "routed": n * rt.cfg.top_k * len(rt.index.layers)}


# ---- the parent ---------------------------------------------------------------------------------
def demo_windows(n: int, prompt: int, decode: int) -> np.ndarray:
    """n windows of prompt + decode tokens of the demo corpus's held-out documents."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from demo_corpus import build_corpus
    from mawforge.pack.manifest import read_manifest
    from mawforge.text.tokenizer import load_tokenizer
    corpus = ROOT / "work" / "corpus"
    if not (corpus / "heldout.txt").exists():
        build_corpus(corpus)
    tok = load_tokenizer(DEMO_PACK, read_manifest(DEMO_PACK).tokenizer)
    ids = np.array(tok.encode((corpus / "heldout.txt").read_text()), np.int64)
    span = prompt + decode
    starts = np.linspace(0, len(ids) - span, n).astype(int)       # spread over the held-out documents
    return np.stack([ids[s:s + span] for s in starts])


def compare(exact: np.ndarray, other: np.ndarray, targets: np.ndarray | None) -> dict:
    pe, po = exact.astype(np.float32), other.astype(np.float32)
    kl = (np.exp(pe) * (pe - po)).sum(-1)
    out = {"kl_mean": float(kl.mean()), "kl_p95": float(np.quantile(kl, 0.95)),
           "top1_agree": float((pe.argmax(-1) == po.argmax(-1)).mean())}
    if targets is not None:
        nll = -po[np.arange(len(targets)), targets]
        out["perplexity"] = float(np.exp(nll.mean()))
    return out


def run(settings, pack: Path, tokens: np.ndarray, prompt: int, extra: list[str], limit: int | None,
        tag: str) -> list[dict]:
    WORK.mkdir(parents=True, exist_ok=True)
    tok_path = WORK / f"miss-{tag}-tokens.npy"
    np.save(tok_path, tokens)
    targets = tokens[:, prompt + 1:]                       # next tokens of every decoded position but the last
    rows, exact = [], None
    for s in settings:
        out = WORK / f"miss-{tag}-{s.replace(':', '_')}.npy"
        row = worker_row(__file__, ["mawforge", "--pack", str(pack), "--policy", s, "--tokens", str(tok_path),
                                    "--prompt-tokens", str(prompt), "--logits-out", str(out), *extra], limit)
        if row["status"] != "ok":
            raise SystemExit(f"{s}: {row['status']}: {row.get('stderr_tail', '')}")
        lp = np.load(out)                                                      # [W * D, V]
        d = tokens.shape[1] - prompt
        keep = np.concatenate([np.arange(w * d, (w + 1) * d - 1) for w in range(len(tokens))])
        if exact is None:
            exact = lp
        row.update(compare(exact[keep], lp[keep], targets.reshape(-1) if tag.startswith("demo") else None))
        row["lossy_share"] = (row["substituted"] + row["skipped"]) / row["routed"]
        row["read_bytes_per_token"] = row["read_bytes"] / row["decode_tokens"]
        rows.append(row)
        print(line(row), flush=True)
        out.unlink()
    return rows


def line(r: dict) -> str:
    ppl = f" ppl {r['perplexity']:.3f}" if "perplexity" in r else ""
    return (f"{r['setting']:>15}: KL {r['kl_mean']:.4f} nats (p95 {r['kl_p95']:.3f}) top-1 {100 * r['top1_agree']:.1f}%"
            f"{ppl} | lossy {100 * r['lossy_share']:.1f}% of routed (sub {r['substituted']}, skip {r['skipped']}) | "
            f"hit {100 * r['hits'] / max(1, r['hits'] + r['misses']):.1f}% | read "
            f"{r['read_bytes_per_token'] / 2**20:.2f} MiB/token | {r['decode_tok_s']:.2f} tok/s")


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "worker":
        ap = argparse.ArgumentParser()
        ap.add_argument("worker")
        ap.add_argument("engine", choices=("mawforge",))
        for f, t in (("--pack", str), ("--policy", str), ("--tokens", str), ("--logits-out", str),
                     ("--cache-percent", float), ("--budget-gib", float), ("--threads", int)):
            ap.add_argument(f, type=t)
        ap.add_argument("--prompt-tokens", type=int, default=64)
        ap.add_argument("--prefetch", default="auto")
        ap.add_argument("--context", type=int, default=1024)
        print(json.dumps(work(ap.parse_args())))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target", choices=("demo", "fullsize"))
    ap.add_argument("--model", help="fullsize: the GGUF file (packed beside it once)")
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--cache-percent", default="25,50", help="demo: expert cache sizes, %% of all experts")
    ap.add_argument("--limit-gib", type=float, default=8.0, help="fullsize: the cgroup's memory limit")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--decode", type=int, default=192)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--record", action="store_true", help="also write benchmarks/records/miss_policy-COMMIT.json")
    a = ap.parse_args(argv)
    settings = a.settings.split(",")
    if settings[0] != "exact":
        raise SystemExit("the first setting must be exact (the reference)")
    q0 = quiet()
    record = {"benchmark": "miss_policy", "target": a.target, "commit": commit(), "machine": machine(),
              "cpu": cpu_kind(), "command": " ".join(sys.argv), "decode": "teacher-forced", "quiet_before": q0,
              "configs": []}
    print(f"# {record['machine']}\n# {record['cpu']['kind']}; quiet: load {q0['loadavg'][0]:.2f}, "
          f"busy {[b['name'] for b in q0['busy']]}")
    if a.target == "demo":
        tokens = demo_windows(a.windows, a.prompt, a.decode)
        for pct in (float(p) for p in a.cache_percent.split(",")):
            print(f"## demo model, expert cache {pct:g}% of the experts, {a.windows} held-out windows of "
                  f"{a.prompt} prompt + {a.decode} teacher-forced tokens")
            rows = run(settings, DEMO_PACK, tokens, a.prompt,
                       ["--cache-percent", str(pct), "--threads", "1", "--prefetch", "none"], None, f"demo{pct:g}")
            record["configs"].append({"cache_percent": pct, "rows": rows})
    else:
        if not a.model:
            raise SystemExit("fullsize needs --model GGUF")
        pack = pack_of(Path(a.model))
        rng = np.random.default_rng(2)
        tokens = rng.integers(1000, 151000, (a.windows, a.prompt + a.decode))
        print(f"## {Path(a.model).name} inside {a.limit_gib:g} GiB, {a.windows} windows of {a.prompt} prompt + "
              f"{a.decode} teacher-forced random ids")
        rows = run(settings, pack, tokens, a.prompt,
                   ["--budget-gib", f"{a.limit_gib * 0.92:.3f}", "--threads", str(a.threads)],
                   int(a.limit_gib * GiB), "full")
        record["configs"].append({"model": Path(a.model).name, "limit_gib": a.limit_gib, "rows": rows})
    finish_record(f"miss_policy-{a.target}", record, a.record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
