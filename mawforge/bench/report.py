"""report.md and plots for a bench run: paper-style tables (validation counts, static plans,
per-cell means and stds, baselines) and figures per (model, context):
decode tok/s and TTFT against cache point, hit rate and materialized bytes against cache
point, and planned F against measured peak RSS over all cells.
"""
from __future__ import annotations

from pathlib import Path

from mawforge.bench.evidence import summary_table

GiB = 1 << 30


def _f(v, fmt: str = "{:.4f}", scale: float = 1.0) -> str:
    return "n/a" if v is None else fmt.format(v / scale)


def _md(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def _counts(rows: list[dict], plans: list[dict]) -> str:
    gen = [r for r in rows if r.get("status") != "rejected"]
    rej = [r for r in rows if r.get("status") == "rejected"]
    items = [("Matrix rows", len(rows)), ("Unique static plan rows", len(plans)),
             ("Feasible static plan rows", sum(bool(p["feasible"]) for p in plans)),
             ("Static budget rejections",
              f"{sum(not p['feasible'] for p in plans)} unique cells, {len(rej)} matrix rows"),
             ("Guarded generation rows", len(gen)),
             ("Valid generation completions", sum(bool(r.get("valid")) for r in gen)),
             ("Memory guard triggers", sum(r.get("status") == "guard" for r in gen)),
             ("Other failures", sum(r.get("status") not in ("ok", "guard") for r in gen))]
    return _md(["Validation component", "Count"], [[k, str(v)] for k, v in items])


def _plans(plans: list[dict]) -> str:
    body = [[p["model"], str(p["context"]), f"{p['cache_percent']:g}%", _f(p["L"], scale=GiB),
             _f(p["F"], scale=GiB), "feasible" if p["feasible"] else "rejected: " + p["reason"]] for p in plans]
    return _md(["Model", "Context", "Cache", "L = C+E+K (GiB)", "F (GiB)", "Decision"], body)


def _cells(table: list[dict], engine_is_mawforge: bool) -> str:
    body = []
    for t in table:
        if (t["engine"] == "mawforge") != engine_is_mawforge:
            continue
        cache = "—" if t["cache_percent"] is None else f"{t['cache_percent']:g}%"
        ms = lambda k, fmt="{:.3f}", scale=1.0: (f"{_f(t[k + '_mean'], fmt, scale)} ± {_f(t[k + '_std'], fmt, scale)}"
                                                 if t[k + "_mean"] is not None else "n/a")
        body.append([t["model"], t["engine"], str(t["context"]), cache, t["prompt_class"], t["statuses"],
                     f"{t['valid_rows']}/{t['rows']}", ms("decode_tok_s", "{:.2f}"), ms("ttft_s"),
                     ms("hit_rate", "{:.2%}") if engine_is_mawforge else "—",
                     ms("materialized_bytes", "{:.4f}", GiB) if engine_is_mawforge else "—",
                     _f(t["max_tree_rss_bytes_mean"], scale=GiB), _f(t["max_system_used_ratio_mean"], "{:.2%}")])
    return _md(["Model", "Engine", "Context", "Cache", "Prompt", "Status", "Valid", "Decode tok/s", "TTFT s",
                "Hit rate", "Materialized GiB", "Tree RSS GiB", "System used"], body)


def _plots(out: Path, table: list[dict], rows: list[dict]) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    made = []
    (out / "plots").mkdir(exist_ok=True)
    maw = [t for t in table if t["engine"] == "mawforge" and t["valid_runs"]]
    for model, ctx in sorted({(t["model"], t["context"]) for t in maw}):
        sel = [t for t in maw if t["model"] == model and t["context"] == ctx]
        for name, panels in (("latency", (("decode_tok_s", "decode tok/s", 1), ("ttft_s", "TTFT (s)", 1))),
                             ("cache", (("hit_rate", "hit rate", 1),
                                        ("materialized_bytes", "materialized (GiB)", GiB)))):
            fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
            for ax, (key, label, scale) in zip(axes, panels):
                for cls in sorted({t["prompt_class"] for t in sel}):
                    pts = sorted((t["cache_percent"], t[key + "_mean"] / scale, (t[key + "_std"] or 0) / scale)
                                 for t in sel if t["prompt_class"] == cls and t[key + "_mean"] is not None)
                    if pts:
                        ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts],
                                    marker="o", capsize=3, label=cls)
                ax.set_xlabel("expert cache (% of routed expert bytes)")
                ax.set_ylabel(label)
                ax.grid(alpha=0.3)
            axes[0].legend(fontsize=8)
            fig.suptitle(f"{model}, context {ctx}")
            fig.tight_layout()
            path = f"plots/{model}-n{ctx}-{name}.png"
            fig.savefig(out / path, dpi=110)
            plt.close(fig)
            made.append(path)
    pts = [(r["plan"]["F"] / GiB, r["memory"]["max_tree_rss_bytes"] / GiB) for r in rows
           if r.get("valid") and r.get("status") == "ok" and r.get("plan")
           and (r.get("memory") or {}).get("max_tree_rss_bytes")]
    if pts:
        fig, ax = plt.subplots(figsize=(4.8, 4.2))
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=14)
        hi = max(max(p) for p in pts) * 1.05
        ax.plot([0, hi], [0, hi], "k--", lw=0.8, label="measured = planned")
        ax.set_xlabel("planned F (GiB)")
        ax.set_ylabel("measured peak process-tree RSS (GiB)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / "plots/planned-vs-rss.png", dpi=110)
        plt.close(fig)
        made.append("plots/planned-vs-rss.png")
    return made


def write_report(out: str | Path, rows: list[dict], plans: list[dict]) -> Path:
    out = Path(out)
    table = summary_table(rows)
    plots = _plots(out, table, rows)
    parts = ["# MawForge validation matrix", "",
             "Rows are valid when the server started, answered HTTP 200 with nonzero completion tokens and "
             "final telemetry, stayed below the memory guard, and shut down cleanly; a static rejection row "
             "is valid when the planner rejected its cell before load. Values are mean ± std over valid "
             "repetitions (descriptive statistics only).", "",
             "## Validation counts", "", _counts(rows, plans), "", "## Static plans", "",
             _plans(plans) if plans else "(no MawForge cells)", "", "## MawForge cells", "", _cells(table, True), "",
             "## Baselines (same prompts, guard and memory limit)", "", _cells(table, False), ""]
    failed = [r for r in rows if not r.get("valid")]
    if failed:
        parts += ["## Invalid rows", "", _md(["Row", "Status", "Reasons"],
                                            [[r["row_id"], r.get("status", "?"), "; ".join(r.get("reasons", []))]
                                             for r in failed]), ""]
    if plots:
        parts += ["## Figures", ""] + [f"![{p}]({p})" for p in plots] + [""]
    path = out / "report.md"
    path.write_text("\n".join(parts))
    return path
