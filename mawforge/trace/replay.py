"""Offline replay: run recorded routing through the live cache code over a policy grid.

`drive()` is the exact call sequence the live runtime makes (see mawforge.cache.core),
so a policy's replayed hit and miss counts equal the live ones for the same trace, budget,
policy spec and prefetch spec. Oracles (mawforge.trace.oracle) give the references.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from mawforge.cache.core import CacheCore, CacheStats, min_capacity, read_bytes
from mawforge.cache.driver import RouteDriver
from mawforge.cache.policies import make_policy
from mawforge.cache.prefetchers import make_prefetcher
from mawforge.errors import RequestError
from mawforge.trace.oracle import ORACLES, access_sequence, belady, next_uses, uniform_sizes
from mawforge.trace.record import LIVE_COUNTERS, Trace, load_trace

UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
         "kb": 10**3, "mb": 10**6, "gb": 10**9}
DEFAULT_POLICIES = "lru,lfu,fifo,random,s3fifo,belady,belady-pinned"
STAT_FIELDS = ("accesses", "hits", "misses", "hit_rate", "evictions", "materialized_bytes",
               "prefetch_issued", "prefetch_issued_bytes", "prefetch_useful", "prefetch_useful_bytes",
               "prefetch_wasted", "prefetch_wasted_bytes", "prefetch_pending_bytes",
               "prefetch_probes", "prefetch_dropped")
ROW_FIELDS = ("trace", "synthetic", "budget", "capacity_bytes", "budget_percent", "policy",
              "policy_spec", "seed", "prefetch", "status", "note", *STAT_FIELDS, "loaded_bytes")


@dataclass(frozen=True)
class Budget:
    label: str
    capacity_bytes: int
    percent: float  # of all routed expert bytes in the trace

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0:
            raise RequestError(f"budget {self.label!r} gives no expert-cache bytes")


def parse_budget(text: str, total_bytes: int) -> Budget:
    """'25%' of all routed expert bytes, or a size: '512MiB', '2GiB', '1000000'."""
    t = text.strip()
    try:
        if t.endswith("%"):
            pct = float(t[:-1])
            cap = int(total_bytes * pct / 100)
        else:
            m = re.fullmatch(r"([0-9.]+)\s*([A-Za-z]*)", t)
            if m is None or m.group(2).lower() not in UNITS:
                raise ValueError
            cap = int(float(m.group(1)) * UNITS[m.group(2).lower()])
            pct = 100.0 * cap / total_bytes
    except ValueError:
        raise RequestError(f"bad budget {text!r}; use e.g. 25%, 512MiB or 2GiB") from None
    return Budget(t, cap, pct)


def drive(trace: Trace, driver: RouteDriver, live: bool = False) -> None:
    """The live runtime's call sequence, applied to a recorded trace. live: also apply what the
    live run decided beside the routing (each step's prefetch on/off under `--prefetch auto`,
    and its router-lookahead prefetches, at the points they were issued), as the live check
    needs; policy comparisons leave it off and compare on routing alone."""
    on = trace.step_prefetch if live and trace.has_live_prefetch else None
    la = trace.lookaheads() if live else {}
    for s, step in enumerate(trace.steps()):
        driver.enabled = True if on is None else bool(on[s])
        driver.begin_step(step.kind, step.n_tokens)
        for r, (layer, experts, weights) in enumerate(step.layers):
            for keys in la.get((s, r), ()):
                driver.lookahead(keys)
            for _ in driver.layer(layer, experts, weights):
                pass  # live: free group.evicted, load group.misses, compute
            driver.after_layer(layer)
        for keys in la.get((s, len(step.layers)), ()):
            driver.lookahead(keys)
        driver.end_step()


LIVE_PREFETCH = "live"   # a prefetch spec: the live run's router lookaheads and on/off windows


def check_prefetch_spec(trace: Trace, spec: str | None) -> None:
    if spec == LIVE_PREFETCH:
        if not trace.has_live_prefetch:     # the five prefetch arrays come all or none
            raise RequestError("--prefetch live needs a trace recorded with prefetch (its router lookaheads "
                               "and on/off windows); this one has none")
    else:
        make_prefetcher(spec)


def replay_policy(trace: Trace, capacity_bytes: int, policy: str,
                  prefetch: str | None = None, live: bool = False) -> CacheStats:
    """prefetch "live": what the live run prefetched beside the routing, issued at the points it
    was (its router lookaheads are the router's picks, not the cache's, so any policy can be
    driven with them); other specs run that prefetcher."""
    if prefetch == LIVE_PREFETCH:
        check_prefetch_spec(trace, prefetch)
        prefetch, live = None, True
    core = CacheCore(capacity_bytes, make_policy(policy))
    drive(trace, RouteDriver(core, trace.block_bytes_fn(), make_prefetcher(prefetch), trace.meta.n_experts), live)
    return core.stats()


def live_check(trace: Trace) -> dict | None:
    """Replay the recorded live configuration; compare with the live counters."""
    live = trace.meta.live
    if not live:
        return None
    stats = replay_policy(trace, live["capacity_bytes"], live["policy"], live["prefetch"], live=True).to_dict()
    replayed = {k: stats[k] for k in LIVE_COUNTERS}
    recorded = {k: live[k] for k in LIVE_COUNTERS}
    return dict(capacity_bytes=live["capacity_bytes"], policy=live["policy"],
                prefetch=live["prefetch"], recorded=recorded, replayed=replayed,
                match=recorded == replayed)


def expand_policies(policies: Iterable[str], seeds: Sequence[int]) -> list[tuple[str, str, int | None]]:
    """-> (family, spec, seed). 'random' fans out over seeds; 'random:N' stays as given."""
    out = []
    for p in policies:
        p = p.strip().lower()
        family, _, arg = p.partition(":")
        if p == "random":
            out += [("random", f"random:{s}", s) for s in seeds]
        elif family == "random":
            out.append(("random", p, int(arg)))
        else:
            if family not in ORACLES:
                make_policy(p)  # fail early on unknown names
            out.append((family, p, None))
    return out


def _row(trace: Trace, budget: Budget, family: str, spec: str, seed, prefetch: str,
         status: str, note: str = "", stats: CacheStats | None = None) -> dict:
    row = dict(trace=trace.meta.model, synthetic=trace.meta.synthetic, budget=budget.label,
               capacity_bytes=budget.capacity_bytes, budget_percent=round(budget.percent, 4),
               policy=family, policy_spec=spec, seed="" if seed is None else seed,
               prefetch=prefetch, status=status, note=note)
    d = stats.to_dict() if stats else {}
    row.update({f: d.get(f, "") for f in STAT_FIELDS})
    row["loaded_bytes"] = read_bytes(d) if stats else ""
    return row


def replay(trace: Trace, budgets: Sequence[str | Budget], policies: Sequence[str],
           seeds: Sequence[int] = (0,), prefetch: Sequence[str] | str = "none") -> list[dict]:
    """The grid: one row per budget x policy spec x prefetch spec (oracles: no prefetch)."""
    total = trace.total_expert_bytes
    budgets = [b if isinstance(b, Budget) else parse_budget(b, total) for b in budgets]
    prefetches = [prefetch] if isinstance(prefetch, str) else list(prefetch)
    for p in prefetches:
        check_prefetch_spec(trace, p)  # fail early
    grid = expand_policies(policies, seeds)
    need = min_capacity(trace.layer_block_sizes(), trace.meta.top_k)
    seq = access_sequence(trace) if any(f in ORACLES for f, _, _ in grid) else None
    nxt = next_uses(seq.keys.tolist()) if seq is not None else None
    rows = []
    for budget in budgets:
        for family, spec, seed in grid:
            for pf in (["n/a"] if family in ORACLES else prefetches):
                if budget.capacity_bytes < need:
                    note = (f"below the minimum {need} bytes (one layer's top-"
                            f"{trace.meta.top_k} working set)")
                    rows.append(_row(trace, budget, family, spec, seed, pf, "rejected", note))
                elif family in ORACLES:
                    stats = belady(seq, budget.capacity_bytes, family == "belady-pinned", nxt)
                    note = ("lower bound (equal block sizes)" if family == "belady" and uniform_sizes(seq)
                            else "farthest-next-use reference (not a bound)")
                    rows.append(_row(trace, budget, family, spec, seed, pf, "ok", note, stats))
                else:
                    stats = replay_policy(trace, budget.capacity_bytes, spec, pf)
                    rows.append(_row(trace, budget, family, spec, seed, pf, "ok", "", stats))
    return rows


def summarize(rows: Sequence[dict]) -> list[dict]:
    """Per budget x policy family x prefetch: hit-rate mean and spread over seeds, and
    regret (hit-rate points, extra misses) against each oracle at the same budget."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["status"] == "ok":
            groups.setdefault((r["budget"], r["policy"], r["prefetch"]), []).append(r)
    oracle = {(b, p): g[0] for (b, p, _), g in groups.items() if p in ORACLES}
    out = []
    for (budget, policy, pf), g in groups.items():
        rates = [r["hit_rate"] for r in g]
        mean = sum(rates) / len(rates)
        std = math.sqrt(sum((x - mean) ** 2 for x in rates) / (len(rates) - 1)) if len(rates) > 1 else 0.0
        misses = sum(r["misses"] for r in g) / len(g)
        s = dict(budget=budget, capacity_bytes=g[0]["capacity_bytes"],
                 budget_percent=g[0]["budget_percent"], policy=policy, prefetch=pf, runs=len(g),
                 hit_rate_mean=mean, hit_rate_std=std, hit_rate_min=min(rates),
                 hit_rate_max=max(rates), misses_mean=misses,
                 loaded_bytes_mean=sum(r["loaded_bytes"] for r in g) / len(g))
        for name in ORACLES:
            o = oracle.get((budget, name))
            s[f"regret_{name}"] = (o["hit_rate"] - mean) if o else ""
            s[f"extra_misses_{name}"] = (misses - o["misses"]) if o else ""
        out.append(s)
    return out


def write_outputs(outdir: Path, trace: Trace, rows: list[dict], summary: list[dict],
                  plots: bool = True, check: dict | None = None) -> dict[str, Path]:
    from mawforge.trace.report import write_report
    outdir.mkdir(parents=True, exist_ok=True)
    paths = {"csv": outdir / "replay.csv", "json": outdir / "replay.json"}
    with open(paths["csv"], "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=ROW_FIELDS)
        w.writeheader()
        w.writerows(rows)
    doc = {"trace": trace.meta.__dict__, "label": trace.meta.label,
           "total_expert_bytes": trace.total_expert_bytes, "live_check": check,
           "rows": rows, "summary": summary}
    paths["json"].write_text(json.dumps(doc, indent=1, default=str))
    paths["report"] = write_report(outdir, trace, rows, summary, plots=plots, check=check)
    return paths


def _csv_list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", help="route trace (.npz) recorded with --trace-out")
    parser.add_argument("--budgets", default="25%,50%,75%",
                        help="comma list: percent of all routed expert bytes, or sizes (512MiB)")
    parser.add_argument("--policies", default=DEFAULT_POLICIES,
                        help=f"comma list of cache policies and oracles (default {DEFAULT_POLICIES})")
    parser.add_argument("--seeds", default="0,1,2,3,4", help="seeds for 'random'")
    parser.add_argument("--prefetch", default="none",
                        help="comma list: none, live (the recorded run's router lookaheads and prefetch "
                             "on/off windows), confidence:0.2, confidence-prefill:0.2, preserve:0.2, "
                             "preserve-prefill:0.2")
    parser.add_argument("-o", "--output", required=True, help="directory for CSV, JSON and report")
    parser.add_argument("--no-plots", action="store_true", help="skip the matplotlib figures")


def main(args: argparse.Namespace) -> int:
    trace = load_trace(args.trace)
    try:
        seeds = [int(s) for s in _csv_list(args.seeds)]
    except ValueError:
        raise RequestError(f"seeds must be integers, got {args.seeds!r}") from None
    rows = replay(trace, _csv_list(args.budgets), _csv_list(args.policies), seeds,
                  _csv_list(args.prefetch) or ["none"])
    summary = summarize(rows)
    check = live_check(trace)
    paths = write_outputs(Path(args.output), trace, rows, summary, plots=not args.no_plots, check=check)
    label = "SYNTHETIC trace" if trace.meta.synthetic else "trace"
    print(f"replayed {label} {args.trace}: {len(rows)} rows -> {paths['report']}")
    for s in summary:
        print(f"  {s['budget']:>10} {s['policy']:<14} {s['prefetch']:<20} "
              f"hit rate {100 * s['hit_rate_mean']:6.2f}%"
              + (f" ± {100 * s['hit_rate_std']:.2f}" if s["runs"] > 1 else "")
              + f"  read {s['loaded_bytes_mean'] / 1e9:.2f} GB")
    if check is not None:
        verdict = "reproduced exactly" if check["match"] else "MISMATCH"
        print(f"live check ({check['policy']}, {check['prefetch']}, {check['capacity_bytes']} bytes): "
              f"{verdict}; recorded {check['recorded']}, replayed {check['replayed']}")
        return 0 if check["match"] else 1
    return 0
