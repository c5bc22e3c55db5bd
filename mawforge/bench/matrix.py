"""`mawforge bench MATRIX.yaml`: the guarded validation matrix (MawForge paper §V).

Stage 1, static: expand every row (matrix.jsonl) and plan each unique (model, context, cache
point) (plans.jsonl); the rows of a rejected cell are valid rejection rows, never run.
Stage 2, guarded: each feasible cell's server runs as a subprocess under the memory guard (and
a cgroup limit with --memory-limit-gib); its rows go over HTTP; evidence is kept for every row.
Rerunning into the same output directory resumes: valid rows are kept, the rest run again.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from mawforge.bench import cgroup
from mawforge.bench.evidence import load_summaries, write_json, write_jsonl, write_summary
from mawforge.bench.executor import CellJob, make_executor
from mawforge.bench.guard import GuardLimits, meminfo
from mawforge.bench.prompts import chat_request
from mawforge.bench.spec import GuardSpec, MatrixSpec, Row, expand, source_for
from mawforge.api import plan_for
from mawforge.plan import Budget, GiB

help = "run the guarded validation matrix and keep the evidence"
SCHEMA = "mawforge.bench/1"


@dataclass(frozen=True)
class BenchResult:
    out: Path
    rows: list[dict]                   # final summaries in matrix order
    plans: list[dict]

    @property
    def counts(self) -> dict[str, int]:
        c: dict[str, int] = {"rows": len(self.rows), "valid": sum(bool(r["valid"]) for r in self.rows)}
        for r in self.rows:
            c[r["status"]] = c.get(r["status"], 0) + 1
        return c


def plan_key(row: Row) -> tuple:
    return (row.model, row.context, row.cache_percent)


def static_stage(spec: MatrixSpec, out: Path) -> tuple[list[Row], dict[tuple, dict]]:
    """matrix.jsonl and plans.jsonl; returns the rows and {(model, context, cache): plan dict}."""
    rows = expand(spec)
    plans: dict[tuple, dict] = {}
    budget = None if spec.budget_gib is None else Budget.from_gib(spec.budget_gib, "the matrix's budget_gib")
    for r in rows:
        if r.engine != "mawforge" or plan_key(r) in plans:
            continue
        pack = source_for(spec, r)
        # the cell's point as the API plans it; the prompt cache left out as in tune.point_plan
        p = plan_for(pack, memory_budget_gib=budget, context=r.context, expert_cache_percent=r.cache_percent,
                     prompt_cache_gib=0.0)
        plans[plan_key(r)] = {"model": r.model, "pack": pack, "context": r.context,
                              "cache_percent": r.cache_percent} | p.to_dict()
    write_jsonl(out / "matrix.jsonl", (r.to_dict() for r in rows))
    write_jsonl(out / "plans.jsonl", plans.values())
    return rows, plans


def _rejection_summary(row: Row, plan: dict) -> dict:
    return row.to_dict() | {"status": "rejected", "valid": True, "reasons": [], "plan": plan,
                            "rejection": plan["reason"], "telemetry": None, "memory": None}


def _limits(g: GuardSpec) -> GuardLimits:
    rss = None if g.tree_rss_gib is None else int(g.tree_rss_gib * GiB)
    return GuardLimits(system_used=g.system_used, tree_rss_bytes=rss, cgroup_used=g.cgroup_used)


def cell_jobs(spec: MatrixSpec, rows: list[Row], plans: dict[tuple, dict], done: set[str]) -> list[CellJob]:
    """One job per feasible cell that still has rows to run (rows in `done` are kept)."""
    cells: dict[str, list[Row]] = {}
    for r in rows:
        plan = plans.get(plan_key(r)) if r.engine == "mawforge" else None
        if (plan is not None and not plan["feasible"]) or r.row_id in done:
            continue
        cells.setdefault(r.cell_id, []).append(r)
    limit = None if spec.memory_limit_gib is None else int(spec.memory_limit_gib * GiB)
    jobs = []
    for cell_id, rs in cells.items():
        r0 = rs[0]
        reqs = tuple((r.row_id, chat_request(r.prompt_class, r.repetition, r.model, spec.max_tokens,
                                             spec.seed, spec.ignore_eos)) for r in rs)
        jobs.append(CellJob(cell_id, r0.model, r0.engine, source_for(spec, r0), r0.context, r0.cache_percent,
                            spec.budget_gib, reqs, spec.max_tokens, spec.threads,
                            spec.serve_args if r0.engine == "mawforge" else (), _limits(spec.guard), limit,
                            spec.start_timeout_s, spec.request_timeout_s,
                            plan=plans.get(plan_key(r0)) if r0.engine == "mawforge" else None,
                            row_meta={r.row_id: r.to_dict() for r in rs}))
    return jobs


def _host() -> dict:
    mi = meminfo()
    return {"hostname": platform.node(), "kernel": platform.release(), "python": platform.python_version(),
            "cpus": os.cpu_count(), "mem_total_bytes": mi["MemTotal"], "cgroup": str(cgroup.own_group())}


def _manifest(out: Path, spec: MatrixSpec, matrix_file: str | None, executor: str) -> dict:
    path = out / "manifest.json"
    man = json.loads(path.read_text()) if path.exists() else {"schema": SCHEMA, "runs": []}
    now = datetime.datetime.now(datetime.timezone.utc).isoformat()
    man.update(matrix=spec.to_dict(), matrix_file=matrix_file, host=_host())
    man["runs"].append({"started": now, "argv": sys.argv, "executor": executor})
    write_json(path, man)
    return man


def bench(spec: MatrixSpec, out: str | Path, *, executor: str = "local", ray_address: str | None = None,
          matrix_file: str | None = None, static_only: bool = False, report: bool = True,
          log=lambda msg: print(msg, file=sys.stderr, flush=True)) -> BenchResult:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    man = _manifest(out, spec, matrix_file, executor)
    if spec.memory_limit_gib is not None:
        for name in cgroup.clean_stale():
            log(f"mawforge bench: removed stale cgroup {name}")
    rows, plans = static_stage(spec, out)
    rejected = sum(not p["feasible"] for p in plans.values())
    log(f"mawforge bench: {len(rows)} rows, {len(plans)} static plans, {rejected} rejected")
    previous = load_summaries(out)
    for r in rows:
        plan = plans.get(plan_key(r)) if r.engine == "mawforge" else None
        if plan is not None and not plan["feasible"]:
            d = out / "rows" / r.row_id
            d.mkdir(parents=True, exist_ok=True)
            write_json(d / "summary.json", _rejection_summary(r, plan))
    done = {k for k, s in previous.items() if s.get("valid") and s.get("status") != "rejected"}
    jobs = [] if static_only else cell_jobs(spec, rows, plans, done)
    log(f"mawforge bench: {len(done)} valid rows kept from before, {len(jobs)} cells to run")
    progress = iter(range(1, len(jobs) + 1))

    def on_done(job: CellJob, summaries: list[dict]) -> None:
        ok = sum(s["valid"] for s in summaries)
        log(f"mawforge bench: [{next(progress)}/{len(jobs)}] {job.cell_id}: {ok}/{len(summaries)} valid")

    make_executor(executor, address=ray_address).run(jobs, out, on_done)
    final = load_summaries(out)
    ordered = [final.get(r.row_id) or r.to_dict() | {"status": "not_run", "valid": False,
                                                     "reasons": ["not run"]} for r in rows]
    write_jsonl(out / "rows.jsonl", ordered)
    write_summary(out, ordered)
    result = BenchResult(out, ordered, list(plans.values()))
    man["runs"][-1].update(ended=datetime.datetime.now(datetime.timezone.utc).isoformat(), counts=result.counts)
    write_json(out / "manifest.json", man)
    if report:
        from mawforge.bench.report import write_report
        write_report(out, ordered, result.plans)
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("matrix", help="the matrix file (YAML); see examples/matrix.yaml")
    p.add_argument("-o", "--out", default=None, help="evidence directory (default: bench-runs/NAME); "
                   "an existing one is resumed")
    p.add_argument("--memory-limit-gib", type=float, default=None,
                   help="run each cell in a cgroup v1 memory limit of this size (page cache included)")
    p.add_argument("--executor", default="local", choices=("local", "ray"))
    p.add_argument("--ray-address", default=None, help="Ray cluster address (default: auto)")
    p.add_argument("--guard-system-used", type=float, default=None,
                   help="stop a cell when the system used ratio crosses this (default 0.98, or the matrix's)")
    p.add_argument("--static-only", action="store_true", help="stage 1 only: expand and plan, run nothing")
    p.add_argument("--no-report", action="store_true", help="skip report.md and the plots")


def _interrupt(signum, frame):
    raise KeyboardInterrupt     # SIGTERM unwinds like Ctrl-C, so cells stop their servers and cgroups


def main(a: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, _interrupt)
    spec = MatrixSpec.load(a.matrix)
    if a.memory_limit_gib is not None:
        spec = replace(spec, memory_limit_gib=a.memory_limit_gib)
    if a.guard_system_used is not None:
        spec = replace(spec, guard=replace(spec.guard, system_used=a.guard_system_used))
    _limits(spec.guard)                            # validate thresholds before anything starts
    out = Path(a.out or Path("bench-runs") / spec.name)
    res = bench(spec, out, executor=a.executor, ray_address=a.ray_address, matrix_file=str(Path(a.matrix).resolve()),
                static_only=a.static_only, report=not a.no_report)
    c = res.counts
    print(f"mawforge bench: {out}: " + ", ".join(f"{k} {v}" for k, v in c.items()))
    return 0 if a.static_only or c["valid"] == c["rows"] else 1
