"""`mawforge tune`: choose the expert-cache point by measured latency (MawForge paper §VI-B:
hit rate is not the objective). Searches the statically feasible cache points coarse to fine,
each measured as a guarded bench cell (the real `mawforge serve` subprocess, a prompt set over
HTTP), reports the curve, recommends a point by an explicit objective and writes a config that
`mawforge serve --config FILE` can load (its "serve" mapping holds serve's own flag names).
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

from mawforge.bench.evidence import write_json, write_jsonl
from mawforge.bench.executor import CellJob, run_cell
from mawforge.bench.guard import GuardLimits
from mawforge.bench.prompts import CLASSES, chat_request
from mawforge.errors import BudgetRejected, FormatError
from mawforge.api import plan_for
from mawforge.plan import FLAG_SOURCE, Budget, GiB, PackFacts, Plan

help = "pick the expert-cache point by measured decode speed and TTFT"
SCHEMA = "mawforge.tune/1"


@dataclass(frozen=True)
class Point:
    cache_percent: float
    valid_runs: int
    decode_tok_s: float | None
    ttft_s: float | None
    hit_rate: float | None
    materialized_bytes: float | None
    max_tree_rss_bytes: int | None
    planned_F_bytes: int
    reasons: tuple[str, ...] = ()


class Objective:
    """How a point is scored; the highest score wins; None = not eligible."""
    registry: dict[str, type["Objective"]] = {}
    name = ""

    def __init_subclass__(cls, name: str, **kw):
        super().__init_subclass__(**kw)
        cls.name = name
        Objective.registry[name] = cls

    def __init__(self, ttft_bound_s: float | None = None, ttft_slack: float = 1.5):
        self.ttft_bound_s, self.ttft_slack = ttft_bound_s, ttft_slack

    def bound(self, curve: list[Point]) -> float | None:
        """The TTFT bound: the one given, else slack x the best TTFT measured on this curve."""
        if self.ttft_bound_s is not None:
            return self.ttft_bound_s
        ttfts = [p.ttft_s for p in curve if p.ttft_s is not None]
        return min(ttfts) * self.ttft_slack if ttfts else None

    def score(self, p: Point, curve: list[Point]) -> float | None:
        raise NotImplementedError

    def describe(self, curve: list[Point]) -> dict:
        return {"name": self.name, "ttft_bound_s": self.bound(curve), "ttft_bound_given": self.ttft_bound_s is not None,
                "ttft_slack": self.ttft_slack}


class DecodeWithinTTFT(Objective, name="decode"):
    """Best mean decode tok/s among points whose mean TTFT is within the bound (the default)."""

    def score(self, p, curve):
        b = self.bound(curve)
        if p.decode_tok_s is None or (b is not None and p.ttft_s > b):
            return None
        return p.decode_tok_s


class LowestTTFT(Objective, name="ttft"):
    """Lowest mean TTFT."""

    def score(self, p, curve):
        return None if p.ttft_s is None else -p.ttft_s


def point_plan(pack: str, budget_gib: float, context: int, cache_percent: float | None = None) -> Plan:
    """The static plan of one cache point through the API. The prompt cache is left out (0), as
    the points span the room the expert cache may take: the served child's auto prompt cache
    takes only the slack a given point leaves (plan.make_plan), never the point's feasibility."""
    return plan_for(pack, memory_budget_gib=Budget.from_gib(budget_gib, FLAG_SOURCE), context=context,
                    expert_cache_percent=cache_percent, prompt_cache_gib=0.0)


def feasible_range(pack: str, budget_gib: float, context: int) -> tuple[float, float]:
    """(smallest, largest) cache percent the planner accepts at this budget and context."""
    facts = PackFacts.from_pack(pack)
    lo = 100.0 * facts.min_cache_bytes / facts.expert_bytes
    plan = point_plan(pack, budget_gib, context)
    hi = plan.max_cache_percent or 0.0
    lo = min(100.0, round(lo + 0.05, 1))            # round up: the planner must accept it
    hi = int(hi * 10) / 10                          # round down
    while hi > lo and not point_plan(pack, budget_gib, context, hi).feasible:
        hi = round(hi - 0.1, 1)
    if hi < lo or not point_plan(pack, budget_gib, context, lo).feasible:
        raise BudgetRejected(f"no expert-cache point fits {budget_gib:g} GiB at context {context}: {plan.reason}")
    return lo, hi


def coarse_points(lo: float, hi: float, n: int) -> list[float]:
    if n < 2 or hi - lo < 0.2:
        return sorted({round(lo, 1), round(hi, 1)})
    return sorted({round(lo + (hi - lo) * i / (n - 1), 1) for i in range(n)})


def refine_points(measured: list[Point], best: float, min_step: float) -> list[float]:
    """Midpoints between the best point and its measured neighbours, where the gap allows."""
    xs = sorted(p.cache_percent for p in measured)
    i = xs.index(best)
    out = []
    for j in (i - 1, i + 1):
        if 0 <= j < len(xs) and abs(xs[j] - best) >= 2 * min_step:
            out.append(round((xs[j] + best) / 2, 1))
    return [x for x in out if x not in xs]


@dataclass(frozen=True)
class TuneSetup:
    pack: str
    budget_gib: float
    context: int
    classes: tuple[str, ...] = CLASSES
    repetitions: int = 1
    max_tokens: int = 32
    threads: int | None = None
    limits: GuardLimits = GuardLimits()
    memory_limit_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.repetitions < 1 or self.max_tokens < 2:
            raise FormatError("tune needs at least 1 repetition and max_tokens >= 2 (decode speed needs 2 tokens)")


def measure(setup: TuneSetup, p: float, out: Path) -> Point:
    plan = point_plan(setup.pack, setup.budget_gib, setup.context, p)
    cell = f"tune.n{setup.context}.p{p:g}"
    reqs = tuple((f"{cell}.{c}.r{r}", chat_request(c, r, "tune", setup.max_tokens, 0))
                 for c in setup.classes for r in range(setup.repetitions))
    job = CellJob(cell, "tune", "mawforge", setup.pack, setup.context, p, setup.budget_gib, reqs, setup.max_tokens,
                  setup.threads, (), setup.limits, setup.memory_limit_bytes, plan=plan.to_dict(),
                  row_meta={rid: {"model": "tune", "engine": "mawforge", "context": setup.context, "cache_percent": p,
                                  "prompt_class": rid.split(".")[-2]} for rid, _ in reqs})
    rows = run_cell(job, out)
    ok = [r for r in rows if r["valid"]]
    mean = lambda k: sum(r["telemetry"][k] for r in ok) / len(ok) if ok else None
    rss = [r["memory"]["max_tree_rss_bytes"] for r in rows if r["memory"]["max_tree_rss_bytes"]]
    return Point(p, len(ok), mean("decode_tok_s"), mean("ttft_s"), mean("hit_rate"), mean("materialized_bytes"),
                 max(rss, default=None), plan.F, tuple(sorted({x for r in rows for x in r["reasons"]})))


def tune(setup: TuneSetup, out: Path, objective: Objective, points: int = 5, rounds: int = 2,
         min_step: float = 1.0, log=lambda m: print(m, file=sys.stderr, flush=True)) -> dict:
    lo, hi = feasible_range(setup.pack, setup.budget_gib, setup.context)
    log(f"mawforge tune: feasible cache points {lo:g}% .. {hi:g}%")
    curve: dict[float, Point] = {}
    todo = coarse_points(lo, hi, points)
    for rnd in range(rounds + 1):
        for p in todo:
            curve[p] = measure(setup, p, out)
            pt = curve[p]
            log(f"mawforge tune: {p:g}%: decode {pt.decode_tok_s or 0:.2f} tok/s, TTFT {pt.ttft_s or 0:.3f} s, "
                f"{pt.valid_runs} valid")
        best = _best(list(curve.values()), objective)
        if best is None or rnd == rounds:
            break
        todo = refine_points(list(curve.values()), best.cache_percent, min_step)
        if not todo:
            break
    pts = sorted(curve.values(), key=lambda q: q.cache_percent)
    best = _best(pts, objective)
    if best is None:
        raise BudgetRejected("no measured cache point produced a valid run; see the evidence in " + str(out))
    result = {"schema": SCHEMA, "serve": {"pack": str(Path(setup.pack).resolve()),
                                          "memory_budget_gib": setup.budget_gib,
                                          "context": setup.context, "expert_cache_percent": best.cache_percent},
              "objective": objective.describe(pts), "recommended": vars(best),
              "feasible_range": [lo, hi], "curve": [vars(p) for p in pts]}
    write_jsonl(out / "curve.jsonl", result["curve"])
    return result


def _best(pts: list[Point], objective: Objective) -> Point | None:
    scored = [(s, p) for p in pts if (s := objective.score(p, pts)) is not None]
    return max(scored, key=lambda sp: (sp[0], -sp[1].cache_percent))[1] if scored else None


def write_config(result: dict, path: Path) -> None:
    if path.suffix in (".yaml", ".yml"):
        import yaml
        path.write_text(yaml.safe_dump(json.loads(json.dumps(result)), sort_keys=False))
    else:
        write_json(path, result)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pack", required=True)
    p.add_argument("--memory-budget-gib", type=float, required=True)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--objective", default="decode", choices=tuple(Objective.registry),
                   help="decode: best decode tok/s with TTFT within the bound (default); ttft: lowest TTFT")
    p.add_argument("--ttft-bound-s", type=float, default=None,
                   help="TTFT bound for --objective decode (default: 1.5 x the best TTFT measured)")
    p.add_argument("--points", type=int, default=5, help="coarse grid size")
    p.add_argument("--rounds", type=int, default=2, help="refinement rounds around the best point")
    p.add_argument("--min-step", type=float, default=1.0, help="stop refining below this gap (percent)")
    p.add_argument("--classes", default=",".join(CLASSES), help="prompt classes, comma-separated")
    p.add_argument("--repetitions", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--memory-limit-gib", type=float, default=None, help="run each point in a cgroup memory limit")
    p.add_argument("--guard-system-used", type=float, default=0.98)
    p.add_argument("-o", "--out", default=None, help="evidence directory (default: tune-runs/PACK-nCONTEXT)")
    p.add_argument("--config-out", default=None, help="config file to write (.json or .yaml; default OUT/tune.json)")


def main(a: argparse.Namespace) -> int:
    from mawforge.bench.matrix import _interrupt
    signal.signal(signal.SIGTERM, _interrupt)
    setup = TuneSetup(a.pack, a.memory_budget_gib, a.context, tuple(c for c in a.classes.split(",") if c),
                      a.repetitions, a.max_tokens, a.threads, GuardLimits(system_used=a.guard_system_used),
                      int(a.memory_limit_gib * GiB) if a.memory_limit_gib else None)
    out = Path(a.out or Path("tune-runs") / f"{Path(a.pack).resolve().name}-n{a.context}")
    out.mkdir(parents=True, exist_ok=True)
    res = tune(setup, out, Objective.registry[a.objective](a.ttft_bound_s), a.points, a.rounds, a.min_step)
    cfg = Path(a.config_out or out / "tune.json")
    write_config(res, cfg)
    print(f"{'cache %':>8} {'decode tok/s':>13} {'TTFT s':>8} {'hit rate':>9} {'valid':>6}")
    for p in res["curve"]:
        f = lambda v, fmt: "n/a" if v is None else fmt.format(v)
        print(f"{p['cache_percent']:>8g} {f(p['decode_tok_s'], '{:.2f}'):>13} {f(p['ttft_s'], '{:.3f}'):>8} "
              f"{f(p['hit_rate'], '{:.1%}'):>9} {p['valid_runs']:>6}")
    o = res["objective"]
    print(f"recommended: --expert-cache-percent {res['serve']['expert_cache_percent']:g} "
          f"(objective {o['name']}, TTFT bound {o['ttft_bound_s'] or 0:.3f} s); config written to {cfg}")
    return 0
