"""The evidence directory of one bench run, and the summary table over its rows.

    OUT/manifest.json        the matrix as given, the command, host facts, start/end times
    OUT/matrix.jsonl         every expanded row (static fields)
    OUT/plans.jsonl          one static plan per unique (model, context, cache point)
    OUT/rows.jsonl           every row's final summary, in matrix order
    OUT/summary.csv|.jsonl   mean and std per (model, engine, context, cache, prompt class)
    OUT/report.md, plots/    tables and figures (mawforge.bench.report)
    OUT/rows/ROW/            request.json, response.json (+ response.raw), telemetry.json,
                             memory.jsonl (samples in the row's window), summary.json
    OUT/cells/CELL/          stdout.log, stderr.log, telemetry.jsonl (the server's log),
                             memory.jsonl (every sample of the cell), cell.json (start, exit,
                             health, metrics, cgroup stats, memory summary)
Rerunning into the same OUT resumes: rows whose summary.json says valid are kept.
"""
from __future__ import annotations

import csv
import json
import math
import os
from pathlib import Path

# summary metrics: name -> how a row yields it (None when the row lacks it)
METRICS = {
    "decode_tok_s": lambda r: (r.get("telemetry") or {}).get("decode_tok_s"),
    "ttft_s": lambda r: (r.get("telemetry") or {}).get("ttft_s"),
    "hit_rate": lambda r: (r.get("telemetry") or {}).get("hit_rate"),
    "materialized_bytes": lambda r: (r.get("telemetry") or {}).get("materialized_bytes"),
    "completion_tokens": lambda r: (r.get("telemetry") or {}).get("completion_tokens"),
    "max_tree_rss_bytes": lambda r: (r.get("memory") or {}).get("max_tree_rss_bytes"),
    "max_system_used_ratio": lambda r: (r.get("memory") or {}).get("max_system_used_ratio"),
    "planned_F_bytes": lambda r: (r.get("plan") or {}).get("F"),
}
GROUP = ("model", "engine", "context", "cache_percent", "prompt_class")


def write_json(path: Path, obj) -> None:
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def write_jsonl(path: Path, rows) -> None:
    tmp = Path(str(path) + ".tmp")
    with open(tmp, "w") as f:
        for r in rows:
            f.write(json.dumps(r, default=str) + "\n")
    os.replace(tmp, path)


def read_jsonl(path: Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def load_summaries(out: Path) -> dict[str, dict]:
    """row_id -> summary.json of every row already in OUT (unreadable ones are skipped: rerun)."""
    found = {}
    for p in Path(out).glob("rows/*/summary.json"):
        try:
            s = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        found[s["row_id"]] = s
    return found


def _mean_std(xs: list[float]) -> tuple[float | None, float | None]:
    if not xs:
        return None, None
    m = sum(xs) / len(xs)
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return m, sd


def summary_table(rows: list[dict]) -> list[dict]:
    """One record per (model, engine, context, cache, class): run counts and mean/std of every
    metric over the valid generation rows; rejected cells appear with status 'rejected'."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(tuple(r.get(k) for k in GROUP), []).append(r)
    out = []
    for key, rs in groups.items():
        valid = [r for r in rs if r.get("valid") and r.get("status") == "ok"]
        rec = dict(zip(GROUP, key)) | {"rows": len(rs), "valid_rows": sum(bool(r.get("valid")) for r in rs),
                                       "valid_runs": len(valid),
                                       "statuses": ",".join(sorted({r.get("status", "?") for r in rs}))}
        for name, get in METRICS.items():
            xs = [float(v) for v in (get(r) for r in (valid or rs)) if v is not None]
            rec[f"{name}_mean"], rec[f"{name}_std"] = _mean_std(xs)
        out.append(rec)
    return out


def write_summary(out: Path, rows: list[dict]) -> list[dict]:
    table = summary_table(rows)
    write_jsonl(Path(out) / "summary.jsonl", table)
    if table:
        with open(Path(out) / "summary.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(table[0]))
            w.writeheader()
            w.writerows(table)
    return table


def check_tree(out: Path) -> list[str]:
    """Parse every .json and .jsonl file under OUT; returns the paths that do not parse."""
    bad = []
    for p in sorted(Path(out).rglob("*")):
        try:
            if p.suffix == ".json":
                json.loads(p.read_text())
            elif p.suffix == ".jsonl":
                read_jsonl(p)
        except (OSError, ValueError):
            bad.append(str(p))
    return bad
