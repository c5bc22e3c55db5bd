"""Two commits of MawForge on the same full-size pack, alternating: did a change (a refactor, say)
keep the speed? Each commit runs from its own git worktree (work/ab/<commit>) as
`benchmarks/fullsize.py worker maw` of THAT commit, so each side is measured with its own code,
on a dropped page cache, resident and inside cgroup v1 memory limits.

    python benchmarks/commit_ab.py --old a88719b --new HEAD [--limits 0,8] [--rounds 3] [--prompt-tokens 2048]
    python benchmarks/commit_ab.py --old f1dbc99~1 --new f1dbc99 --fill-context 32768   # decode at 32K positions
    python benchmarks/commit_ab.py --old A --new B --fill-context 4096 --decode-tokens 30 --warmup 15

Per configuration and commit: the teacher-forced decode tok/s, greedy tok/s and TTFT of each
round, their medians, and new/old ratios; the rounds alternate which commit goes first. With
--fill-context N each side decodes after N synthetic cached positions, as long_context.py runs the
worker (teacher-forced tokens only: no greedy run, TTFT is one token's).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
from common import ROOT, fill_args, machine, pack_of, save, synth_model, worker_row  # noqa: E402

GiB = 2**30


def tree(rev: str) -> tuple[str, str]:
    """(full sha, worktree path) of a revision, checked out once under work/ab/."""
    sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", rev], capture_output=True, text=True,
                         check=True).stdout.strip()
    path = ROOT / "work" / "ab" / sha[:12]
    if not (path / "mawforge").is_dir():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(path), sha],
                       check=True, capture_output=True)
    # compile that tree's native kernels now, so no child's first prompt pays for the compiler
    subprocess.run([sys.executable, "-c", "from mawforge.kernels import native; assert native.available()"],
                   check=True, env={**os.environ, "PYTHONPATH": str(path)})
    return sha, str(path)


def row(path: str, pack: str, gib: float | None, rounds_tag: str, timeout: float, prompt_tokens: int | None,
        fill: int | None = None, decode: int = 10, warmup: int = 2) -> dict:
    if fill:                                            # long_context.py's worker arguments
        args = ["maw", "--pack", pack, *fill_args(fill, decode, warmup)]
    else:
        args = ["maw", "--pack", pack, "--classes", "code", "--greedy-tokens", "16"]
        if prompt_tokens:                               # TTFT is this prompt's prefill
            args += ["--prompt-tokens", str(prompt_tokens)]
    if gib is None:
        args += ["--cache-percent", "100", "--preload"]
    else:
        args += ["--budget-gib", f"{gib * 0.92:.3f}"]      # as fullsize.py: 8% to the page cache and kernel
    r = worker_row(os.path.join(path, "benchmarks", "fullsize.py"), args, int(gib * GiB) if gib else None,
                   timeout, env={"PYTHONPATH": path})
    r["round"] = rounds_tag
    return r


def greedy(r: dict) -> float:
    g = [v["decode_tok_s"] for v in r.get("greedy", {}).values()]
    return statistics.median(g) if g else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True)
    ap.add_argument("--new", default="HEAD")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--limits", default="0,8", help="GiB; 0 = resident (whole model in memory)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--prompt-tokens", type=int, default=None, help="the random prompt (default: the worker's 64)")
    ap.add_argument("--fill-context", type=int, default=None, help="decode after this many cached positions")
    ap.add_argument("--decode-tokens", type=int, default=10,
                    help="with --fill-context: teacher-forced steps, the first --warmup untimed")
    ap.add_argument("--warmup", type=int, default=2, help="with --fill-context: untimed first steps (inside a "
                    "limit the expert cache fills during them; long_context.py's battery uses 15)")
    a = ap.parse_args()
    if a.fill_context is not None and a.prompt_tokens is not None:
        ap.error("--fill-context and --prompt-tokens are two different runs; give one")
    sides = {"old": tree(a.old), "new": tree(a.new)}
    pack = str(pack_of(synth_model(a.layers, "Q4_K_M", skew=1.0, stickiness=0.3)))
    rows = []
    for lim in [float(x) for x in a.limits.split(",") if x.strip()]:
        gib = lim or None
        config = "resident" if gib is None else f"{lim:g} GiB"
        for k in range(a.rounds):
            order = ("old", "new") if k % 2 == 0 else ("new", "old")
            for side in order:
                r = row(sides[side][1], pack, gib, str(k), a.timeout, a.prompt_tokens, a.fill_context, a.decode_tokens,
                        a.warmup)
                r.update(config=config, side=side, commit=sides[side][0][:12])
                rows.append(r)
                print(json.dumps({k2: r.get(k2) for k2 in ("config", "side", "commit", "round", "status",
                                                          "ttft_s", "decode_tok_s")} | {"greedy": greedy(r)}),
                      flush=True)
    print(f"\n# commit A/B, {machine()}; old {sides['old'][0][:12]}, new {sides['new'][0][:12]}")
    for config in dict.fromkeys(r["config"] for r in rows):
        med = {}
        for side in ("old", "new"):
            rs = [r for r in rows if r["config"] == config and r["side"] == side and r["status"] == "ok"]
            if not rs:
                continue
            med[side] = {m: statistics.median(f(r) for r in rs) for m, f in
                         (("tf", lambda r: r["decode_tok_s"]), ("greedy", greedy), ("ttft", lambda r: r["ttft_s"]))}
            print(f"{config:9s} {side}: TF " + ", ".join(f"{r['decode_tok_s']:.2f}" for r in rs)
                  + f" (median {med[side]['tf']:.2f}); greedy median {med[side]['greedy']:.2f}; "
                  f"TTFT median {med[side]['ttft']:.2f} s")
        if len(med) == 2:
            ratio = {m: med["new"][m] / med["old"][m] for m in ("tf", "greedy", "ttft")}
            print(f"{config:9s} new/old: TF {ratio['tf']:.3f}, greedy {ratio['greedy']:.3f}, "
                  f"TTFT {ratio['ttft']:.3f}")
    print(f"saved {save('commit_ab', {'machine': machine(), 'rows': rows})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
