"""The replay report: Markdown tables plus matplotlib figures (Agg backend, PNG files).

The reuse-distance histogram explains capacity cliffs: with LRU and no pins, an access
hits exactly when the bytes of distinct blocks touched since its previous use, plus its
own size, fit the capacity, so a budget just left of a tall bar loses all of those hits.

Legend: A accesses.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from mawforge.trace.oracle import ORACLES, AccessSeq, access_sequence, uniform_sizes
from mawforge.trace.record import Trace

REUSE_MAX_ACCESSES = 200_000  # pure-Python Fenwick tree; keeps the report quick
MIB = float(1 << 20)


def reuse_distances(seq: AccessSeq, max_accesses: int = REUSE_MAX_ACCESSES) -> np.ndarray:
    """Per access, bytes of distinct other blocks used since the key's previous access
    (LRU stack distance in bytes); -1 for first uses. First max_accesses accesses only."""
    keys = seq.keys[:max_accesses].tolist()
    sizes = seq.sizes[:max_accesses].tolist()
    n = len(keys)
    tree = [0] * (n + 1)  # Fenwick tree over positions: size at each key's latest position

    def add(i: int, v: int) -> None:
        i += 1
        while i <= n:
            tree[i] += v
            i += i & -i

    def prefix(i: int) -> int:  # sum of positions [0, i)
        s = 0
        while i > 0:
            s += tree[i]
            i -= i & -i
        return s

    last: dict[int, int] = {}
    out = np.full(n, -1, dtype=np.int64)
    for i, (k, size) in enumerate(zip(keys, sizes)):
        p = last.get(k)
        if p is not None:
            out[i] = prefix(i) - prefix(p + 1)
            add(p, -size)
        add(i, size)
        last[k] = i
    return out


def _fmt_rate(s: dict) -> str:
    text = f"{100 * s['hit_rate_mean']:.2f}%"
    if s["runs"] > 1:
        text += f" ± {100 * s['hit_rate_std']:.2f} (n={s['runs']})"
    return text


def _fmt_regret(value) -> str:
    return "–" if value == "" else f"{100 * value:+.2f}"


def _table(summary: Sequence[dict], budgets: list[str], cell) -> list[str]:
    series = sorted({(s["policy"], s["prefetch"]) for s in summary},
                    key=lambda p: (p[0] in ORACLES, p))
    lines = ["| policy | prefetch | " + " | ".join(budgets) + " |",
             "|---|---|" + "---|" * len(budgets)]
    by = {(s["policy"], s["prefetch"], s["budget"]): s for s in summary}
    for pol, pf in series:
        cells = [cell(by[(pol, pf, b)]) if (pol, pf, b) in by else "–" for b in budgets]
        lines.append(f"| {pol} | {pf} | " + " | ".join(cells) + " |")
    return lines


def _plots(outdir: Path, summary: Sequence[dict], dist: np.ndarray,
           budgets: list[tuple[str, int]], label: str) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    series = sorted({(s["policy"], s["prefetch"]) for s in summary})
    fig, ax = plt.subplots(figsize=(9.5, 4.5))
    for pol, pf in series:
        pts = sorted((s["capacity_bytes"], s["hit_rate_mean"], s["hit_rate_std"])
                     for s in summary if (s["policy"], s["prefetch"]) == (pol, pf))
        x = [p[0] / MIB for p in pts]
        name = pol if pf in ("none", "n/a") else f"{pol} + {pf}"
        ax.errorbar(x, [100 * p[1] for p in pts], yerr=[100 * p[2] for p in pts],
                    marker="o", capsize=3, linestyle="--" if pol in ORACLES else "-", label=name)
    ax.set(xlabel="expert-cache capacity (MiB)", ylabel="demand hit rate (%)",
           title=f"Hit rate vs budget ({label})")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
    fig.tight_layout()
    fig.savefig(outdir / "hit_rate.png", dpi=110)
    plt.close(fig)
    names.append("hit_rate.png")

    fig, axes = plt.subplots(1, len(ORACLES), figsize=(10, 4), sharey=True)
    for ax, oracle in zip(axes, ORACLES):
        for pol, pf in series:
            if pol in ORACLES:
                continue
            pts = sorted((s["capacity_bytes"], s[f"regret_{oracle}"]) for s in summary
                         if (s["policy"], s["prefetch"]) == (pol, pf) and s[f"regret_{oracle}"] != "")
            if pts:
                name = pol if pf == "none" else f"{pol} + {pf}"
                ax.plot([p[0] / MIB for p in pts], [100 * p[1] for p in pts], marker="o", label=name)
        ax.axhline(0, color="grey", linewidth=0.8)
        ax.set(xlabel="capacity (MiB)", title=f"regret vs {oracle} ({label})")
    axes[0].set_ylabel("hit-rate points below the oracle")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(outdir / "regret.png", dpi=110)
    plt.close(fig)
    names.append("regret.png")

    fig, ax = plt.subplots(figsize=(7, 4.5))
    reused = dist[dist >= 0] / MIB
    if len(reused):
        ax.hist(reused, bins=60, color="tab:blue", alpha=0.7)
        cdf = ax.twinx()
        xs = np.sort(reused)
        cdf.plot(xs, 100 * np.arange(1, len(xs) + 1) / len(dist), color="tab:orange")
        cdf.set_ylabel("accesses with distance ≤ x (% of all)")
    for name, cap in budgets:
        ax.axvline(cap / MIB, color="red", linestyle=":", linewidth=1)
        ax.text(cap / MIB, ax.get_ylim()[1] * 0.95, name, rotation=90, fontsize=7, va="top")
    ax.set(xlabel="reuse distance (MiB of distinct blocks in between)", ylabel="accesses",
           title=f"Reuse distances ({label})")
    fig.tight_layout()
    fig.savefig(outdir / "reuse_distance.png", dpi=110)
    plt.close(fig)
    names.append("reuse_distance.png")
    return names


def _live_lines(check: dict | None) -> list[str]:
    if check is None:
        return ["No live counters in this trace: no live check.", ""]
    verdict = "reproduced exactly" if check["match"] else "**MISMATCH**"
    return [f"Live check ({check['policy']}, prefetch {check['prefetch']}, "
            f"{check['capacity_bytes']} bytes): {verdict}. Recorded `{check['recorded']}`, "
            f"replayed `{check['replayed']}`.", ""]


def write_report(outdir: Path, trace: Trace, rows: Sequence[dict], summary: Sequence[dict],
                 plots: bool = True, check: dict | None = None) -> Path:
    meta = trace.meta
    label = "SYNTHETIC" if meta.synthetic else "recorded"
    seq = access_sequence(trace)
    dist = reuse_distances(seq)
    budget_caps = {}
    for r in rows:
        budget_caps.setdefault(r["budget"], r["capacity_bytes"])
    budgets = sorted(budget_caps, key=budget_caps.get)
    lines = [f"# Cache-policy replay — {meta.model or 'unnamed model'} ({label} trace)", ""]
    if meta.synthetic:
        lines += ["> **SYNTHETIC trace**: generated routing with parameters "
                  f"`{meta.synthetic_params}`; it says nothing about a real model.", ""]
    steps = trace.step_kind
    lines += [
        f"- layers {meta.n_layers}, experts per layer {meta.n_experts}, top-k {meta.top_k}",
        f"- steps: {int((steps == 0).sum())} prefill, {int((steps == 1).sum())} decode; "
        f"{len(seq.keys)} block accesses",
        f"- all routed expert bytes: {trace.total_expert_bytes} "
        f"({trace.total_expert_bytes / MIB:.1f} MiB); block sizes "
        + ("uniform" if uniform_sizes(seq) else "mixed"),
        f"- pack digest: `{meta.pack_digest or 'n/a'}`", "",
        *_live_lines(check),
        "## Demand hit rate", "",
        "Hits and misses count block accesses (one per distinct expert of a layer group). "
        "Random eviction: mean ± sample standard deviation over seeds.", ""]
    lines += _table(summary, budgets, _fmt_rate)
    for oracle in ORACLES:
        lines += ["", f"## Regret vs {oracle}", "",
                  "Hit-rate points below the oracle at the same budget (negative: better than it, "
                  "possible with prefetch or when the oracle is only a heuristic).", ""]
        lines += _table([s for s in summary if s["policy"] not in ORACLES], budgets,
                        lambda s, o=oracle: _fmt_regret(s[f"regret_{o}"]))
    pf_rows = [r for r in rows if r["status"] == "ok" and r["prefetch"] not in ("none", "n/a")]
    if pf_rows:
        lines += ["", "## Prefetch", "",
                  "| budget | policy | prefetch | issued | useful | wasted | pending | probes | loaded MiB |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in pf_rows:
            lines.append(f"| {r['budget']} | {r['policy_spec']} | {r['prefetch']} | {r['prefetch_issued']} "
                         f"| {r['prefetch_useful']} | {r['prefetch_wasted']} | "
                         f"{r['prefetch_pending_bytes'] / MIB:.1f} MiB | {r['prefetch_probes']} | "
                         f"{r['loaded_bytes'] / MIB:.1f} |")
    rejected = sorted({(r["budget"], r["note"]) for r in rows if r["status"] == "rejected"})
    if rejected:
        lines += ["", "## Rejected budgets", ""] + [f"- {b}: {note}" for b, note in rejected]
    reused = dist[dist >= 0]
    lines += ["", "## Reuse distances", "",
              f"Over the first {len(dist)} accesses: {len(dist) - len(reused)} first uses; "
              + (f"median reuse distance {np.median(reused) / MIB:.1f} MiB, 90th percentile "
                 f"{np.percentile(reused, 90) / MIB:.1f} MiB." if len(reused) else "no reuse."),
              "Without pins, LRU hits an access exactly when its reuse distance plus its own "
              "size fits the capacity; a cliff sits where many accesses share one distance.", "",
              "## Oracles", "",
              "- `belady`: farthest-next-use without pins. With uniform block sizes its misses "
              "are a lower bound for every policy here; with mixed sizes it is a heuristic.",
              "- `belady-pinned`: the same rule with the current layer group's blocks pinned, "
              "as in the live cache; a feasible clairvoyant schedule, not a proven optimum."]
    if plots:
        caps = [(b, budget_caps[b]) for b in budgets]
        try:
            names = _plots(outdir, summary, dist, caps, label)
        except ImportError:
            names = []
            lines += ["", "(matplotlib is not installed: no figures)"]
        lines += [""] + [f"![{n[:-4]}]({n})" for n in names]
    path = outdir / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path
