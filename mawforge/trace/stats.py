"""`mawforge trace stats TRACE`: how a route trace routes, in the terms published measurements of
real models use, so a synthetic file's routing can be set beside a real one's; and `mawforge trace
import-bmoe ROUTE.csv -o TRACE.npz`: BigMoeOnEdge's route trace (its documented `route_trace v1`
CSV) as a MawForge trace, so replay and these statistics run on it.

Per layer, over the tokens of the chosen phase (decode by default, one token a step), with S_t the
set of experts token t routed to in that layer and k the top-k:

- repeat at lag d: |S_t & S_(t-d)| / k, averaged (lag 1 and 8); within 8: the share of S_t seen in
  any of the 8 tokens before;
- reuse distance: for each routing, the tokens since that expert of that layer was last routed
  (first routings excluded), as quantiles, and the share of routings that are first ones;
- popularity entropy: of each layer's routing counts, as a share of log2(n_experts) (1: uniform);
- static hot set: the hottest `hot` share of each layer's experts counted on the first half of the
  tokens, and the share of the second half's routings it covers;
- hit curves: LRU, S3-FIFO and Belady (the replay's own policy code) at expert-cache sizes given as
  shares of all expert bytes, over the whole trace (prefill included where the trace has one).
"""
from __future__ import annotations

import argparse
import csv
import json
import math
from pathlib import Path

import numpy as np

from mawforge.errors import FormatError
from mawforge.trace.record import STEP_KINDS, Trace, TraceMeta, _block_table, load_trace

LAGS = (1, 8)
QUANTILES = (0.25, 0.5, 0.75, 0.9)
DEFAULT_BUDGETS = ("10%", "20%", "40%")
DEFAULT_POLICIES = ("lru", "s3fifo", "belady")


def layer_routes(trace: Trace, phase: str = "decode") -> list[np.ndarray]:
    """Per layer, the experts each token of `phase` ("decode", "prefill" or "all") routed to,
    [T, k] in token order."""
    want = {"decode": {"decode"}, "prefill": {"prefill"}, "all": set(STEP_KINDS)}.get(phase)
    if want is None:
        raise FormatError(f"phase must be decode, prefill or all, got {phase!r}")
    per: list[list[np.ndarray]] = [[] for _ in range(trace.meta.n_layers)]
    for st in trace.steps():
        if st.kind in want:
            for layer, experts, _ in st.layers:
                per[layer].append(np.asarray(experts))
    k = trace.meta.top_k
    return [np.concatenate(p) if p else np.zeros((0, k), np.int64) for p in per]


def _repeat(routes: np.ndarray, lag: int) -> float | None:
    if len(routes) <= lag:
        return None
    a, b = routes[lag:], routes[:-lag]
    hits = ((a[:, :, None] == b[:, None, :]).any(axis=2) & (a >= 0)).sum()
    return float(hits / max(1, (a >= 0).sum()))


def _within(routes: np.ndarray, n_experts: int, window: int) -> float | None:
    if len(routes) <= window:
        return None
    last = np.full(n_experts, -10**9)
    hits = total = 0
    for t, row in enumerate(routes):
        row = row[row >= 0]                       # -1: a miss a lossy decode skipped
        if t >= window:
            hits += int(((t - last[row]) <= window).sum())
            total += len(row)
        last[row] = t
    return hits / total if total else None


def _distances(routes: np.ndarray, n_experts: int) -> tuple[np.ndarray, int]:
    """Reuse distances in tokens of every routing after an expert's first, and the count of firsts."""
    last = np.full(n_experts, -1)
    out, firsts = [], 0
    for t, row in enumerate(routes):
        row = row[row >= 0]
        seen = last[row]
        firsts += int((seen < 0).sum())
        out.append(t - seen[seen >= 0])
        last[row] = t
    return (np.concatenate(out) if out else np.zeros(0, np.int64)), firsts


def _entropy(routes: np.ndarray, n_experts: int) -> float | None:
    if not len(routes):
        return None
    flat = routes[routes >= 0]
    p = np.bincount(flat, minlength=n_experts) / max(1, flat.size)
    p = p[p > 0]
    return float(-(p * np.log2(p)).sum() / math.log2(n_experts))


def _hot_coverage(routes: np.ndarray, n_experts: int, hot: float) -> float | None:
    half = len(routes) // 2
    if half < 1:
        return None
    first, rest = routes[:half], routes[half:]
    counts = np.bincount(first[first >= 0], minlength=n_experts)
    top = np.argsort(-counts, kind="stable")[:max(1, round(hot * n_experts))]
    rest = rest[rest >= 0]
    return float(np.isin(rest, top).mean()) if rest.size else None


def _mean(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return float(np.mean(xs)) if xs else None


def routing_stats(trace: Trace, phase: str = "decode", hot: float = 0.4,
                  budgets=DEFAULT_BUDGETS, policies=DEFAULT_POLICIES) -> dict:
    """The statistics of the module docstring: per layer and averaged over layers."""
    if not 0 < hot < 1:
        raise FormatError(f"the hot set is a share of the experts in (0, 1), got {hot}")
    E = trace.meta.n_experts
    routes = layer_routes(trace, phase)
    per_layer = []
    all_d, firsts, n_routings = [], 0, 0
    for layer, r in enumerate(routes):
        d, f = _distances(r, E)
        all_d.append(d)
        firsts += f
        n_routings += int((r >= 0).sum())
        per_layer.append({"layer": layer, "tokens": len(r), **{f"repeat_lag{g}": _repeat(r, g) for g in LAGS},
                          "within_8": _within(r, E, 8), "entropy": _entropy(r, E),
                          "hot_coverage": _hot_coverage(r, E, hot)})
    d = np.concatenate(all_d) if all_d else np.zeros(0)
    out = {"phase": phase, "tokens": max((len(r) for r in routes), default=0), "layers": len(routes),
           "n_experts": E, "top_k": trace.meta.top_k, "hot_share": hot, "model": trace.meta.model,
           "synthetic": trace.meta.synthetic,
           **{f"repeat_lag{g}": _mean(x[f"repeat_lag{g}"] for x in per_layer) for g in LAGS},
           "within_8": _mean(x["within_8"] for x in per_layer),
           "reuse_distance": {f"p{int(q * 100)}": (float(np.quantile(d, q)) if len(d) else None) for q in QUANTILES},
           "first_routings": firsts / n_routings if n_routings else None,
           "entropy": _mean(x["entropy"] for x in per_layer),
           "hot_coverage": _mean(x["hot_coverage"] for x in per_layer), "per_layer": per_layer}
    out["hit_curves"] = hit_curves(trace, budgets, policies) if budgets else []
    return out


def hit_curves(trace: Trace, budgets, policies) -> list[dict]:
    from mawforge.trace.replay import replay
    rows = replay(trace, list(budgets), list(policies))
    return [{"budget": r["budget"], "policy": r["policy"], "hit_rate": r.get("hit_rate"), "status": r["status"]}
            for r in rows]


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def format_stats(s: dict) -> str:
    e = [x["entropy"] for x in s["per_layer"] if x["entropy"] is not None]
    lines = [f"{s['model'] or 'trace'} ({'synthetic' if s['synthetic'] else 'recorded'}): {s['layers']} layers, "
             f"{s['n_experts']} experts, top-{s['top_k']}; {s['tokens']} {s['phase']} tokens",
             f"repeat at lag 1        {_pct(s['repeat_lag1'])} of a token's experts",
             f"repeat at lag 8        {_pct(s['repeat_lag8'])}",
             f"seen within 8 tokens   {_pct(s['within_8'])}",
             "reuse distance         "
             + ", ".join(f"{k} {v:g}" for k, v in s["reuse_distance"].items() if v is not None)
             + f" tokens; first routings {_pct(s['first_routings'])}",
             f"popularity entropy     {s['entropy']:.3f} of uniform (layers {min(e):.3f}-{max(e):.3f}; "
             f"first {e[0]:.3f}, last {e[-1]:.3f})" if e else "popularity entropy     -",
             f"static hot set         the hottest {s['hot_share']:.0%} (learned on the first half) covers "
             f"{_pct(s['hot_coverage'])} of the second half"]
    if s["hit_curves"]:
        budgets = list(dict.fromkeys(r["budget"] for r in s["hit_curves"]))
        lines.append("hit rate by cache size  " + "  ".join(f"{b:>8}" for b in budgets))
        for pol in dict.fromkeys(r["policy"] for r in s["hit_curves"]):
            cells = {r["budget"]: r for r in s["hit_curves"] if r["policy"] == pol}
            lines.append(f"  {pol:<21} " + "  ".join(
                f"{_pct(cells[b]['hit_rate']) if cells[b]['status'] == 'ok' else 'n/a':>8}" for b in budgets))
    return "\n".join(lines)


# ---- BigMoeOnEdge's route trace -----------------------------------------------------------

def _preamble(lines: list[str], path: Path) -> tuple[dict, dict[int, int]]:
    if not lines or lines[0].strip() != "# route_trace v1":
        raise FormatError(f"{path}: not a BigMoeOnEdge route trace (no '# route_trace v1' first line)")
    facts, sizes = {}, {}
    for ln in lines[1:]:
        kv = dict(tok.split("=", 1) for tok in ln.lstrip("#").split() if "=" in tok)
        if "layer" in kv and "expert_bytes" in kv:
            sizes[int(kv["layer"])] = int(kv["expert_bytes"])
        else:
            facts.update(kv)
    for key in ("n_layer", "n_expert", "n_expert_used"):
        if key not in facts:
            raise FormatError(f"{path}: the preamble does not give {key}")
    return facts, sizes


def import_bmoe(path: str | Path) -> Trace:
    """BigMoeOnEdge's `route_trace v1` CSV (columns read by name) as a MawForge trace: one decode
    step per decode position, and each turn's prefill as one step over the layers that routed every
    prompt token (its last MoE layer routes only the last one, and is left out of that step).
    MoE layers are renumbered 0.. in order; a weight given as nan becomes 1/k."""
    path = Path(path)
    with open(path, newline="") as f:
        head, body = [], []
        for ln in f:
            (head if ln.startswith("#") and not body else body).append(ln)
    facts, sizes = _preamble(head, path)
    k, E = int(facts["n_expert_used"]), int(facts["n_expert"])
    rows = csv.DictReader(body)
    need = {"turn", "phase", "step", "layer", "slot", "expert", "weight"}
    if rows.fieldnames is None or not need <= set(rows.fieldnames):
        raise FormatError(f"{path}: the header lacks {', '.join(sorted(need - set(rows.fieldnames or ())))}")
    cells: dict[tuple[int, int, int, int], list] = {}
    for i, r in enumerate(rows):
        try:
            key = (int(r["turn"]), int(r["phase"]), int(r["step"]), int(r["layer"]))
            slot, e, w = int(r["slot"]), int(r["expert"]), float(r["weight"])
        except (TypeError, ValueError):
            raise FormatError(f"{path}: row {i + 2} is not a route row") from None
        if not (0 <= slot < k and 0 <= e < E):
            raise FormatError(f"{path}: row {i + 2}: slot {slot} or expert {e} out of range")
        cells.setdefault(key, [None] * k)[slot] = (e, w)
    if any(None in v for v in cells.values()):
        raise FormatError(f"{path}: a (turn, phase, step, layer) cell lacks some of its {k} slots")
    moe_layers = sorted({key[3] for key in cells})
    index = {layer: i for i, layer in enumerate(moe_layers)}
    L = len(moe_layers)
    kinds, tokens, rec_step, rec_layer, ex, wt = [], [], [], [], [], []

    def emit(kind: str, layer_rows: dict[int, list]) -> None:
        n = len(next(iter(layer_rows.values())))
        s = len(kinds)
        kinds.append(STEP_KINDS.index(kind))
        tokens.append(n)
        for layer in sorted(layer_rows):
            rec_step.append(s)
            rec_layer.append(index[layer])
            for cell in layer_rows[layer]:
                ex.append([e for e, _ in cell])
                w = np.array([w for _, w in cell], np.float32)
                wt.append(np.where(np.isfinite(w), w, 1.0 / k))

    for turn in sorted({key[0] for key in cells}):
        pre: dict[int, list] = {}
        for (t, ph, step, layer) in sorted(c for c in cells if c[0] == turn and c[1] == 0):
            pre.setdefault(layer, []).append(cells[(t, ph, step, layer)])
        if pre:
            n = max(len(v) for v in pre.values())
            full = {layer: v for layer, v in pre.items() if len(v) == n}
            emit("prefill", full)
        for step in sorted({c[2] for c in cells if c[0] == turn and c[1] == 1}):
            emit("decode", {c[3]: [cells[c]] for c in cells if c[:3] == (turn, 1, step)})
    if not kinds:
        raise FormatError(f"{path}: no routed rows")
    block = [sizes.get(layer, 1) or 1 for layer in moe_layers]
    meta = TraceMeta(n_layers=L, n_experts=E, top_k=k, model=f"BigMoeOnEdge route trace: {facts.get('model', '?')}"
                     f" ({facts.get('arch', '?')})")
    return Trace(meta=meta, block_bytes=_block_table(block, L, E), step_kind=np.asarray(kinds, np.uint8),
                 step_tokens=np.asarray(tokens, np.int32), rec_step=np.asarray(rec_step, np.int32),
                 rec_layer=np.asarray(rec_layer, np.int32), experts=np.asarray(ex, np.int32).reshape(-1, k),
                 weights=np.asarray(wt, np.float32).reshape(-1, k))


# ---- CLI ----------------------------------------------------------------------------------
help = "route-trace tools: `stats TRACE` (repeat rates, reuse, entropy, hot sets, hit curves), `import-bmoe CSV`"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    s = sub.add_parser("stats", help="routing statistics of a trace (.npz) or a BigMoeOnEdge route CSV")
    s.add_argument("trace")
    s.add_argument("--phase", choices=("decode", "prefill", "all"), default="decode")
    s.add_argument("--hot", type=float, default=0.4, help="static hot set: this share of each layer's experts")
    s.add_argument("--budgets", default=",".join(DEFAULT_BUDGETS),
                   help="expert-cache sizes for the hit curves ('' for none)")
    s.add_argument("--policies", default=",".join(DEFAULT_POLICIES))
    s.add_argument("--json", action="store_true")
    i = sub.add_parser("import-bmoe", help="a BigMoeOnEdge route trace CSV as a MawForge trace")
    i.add_argument("csv")
    i.add_argument("-o", "--output", required=True)


def _open(path: str) -> Trace:
    p = Path(path)
    if not p.is_file():
        raise FormatError(f"{p}: no such trace file")
    if p.suffix == ".csv":
        return import_bmoe(p)
    return load_trace(p)


def main(a: argparse.Namespace) -> int:
    if a.action == "import-bmoe":
        t = import_bmoe(a.csv)
        out = t.save(a.output)
        print(f"{out}: {t.n_steps} steps, {t.meta.n_layers} MoE layers, {t.meta.n_experts} experts, "
              f"top-{t.meta.top_k}")
        return 0
    t = _open(a.trace)
    budgets = [b for b in a.budgets.split(",") if b.strip()]
    s = routing_stats(t, a.phase, a.hot, budgets, [p for p in a.policies.split(",") if p.strip()])
    print(json.dumps(s, indent=1) if a.json else format_stats(s))
    return 0
