"""`mawforge trace stats` and `trace import-bmoe`: routing statistics checked on hand-made routes,
on synthetic traces whose reuse is known, and on a BigMoeOnEdge route trace in its documented format."""
import json
import math

import numpy as np
import pytest

from mawforge.errors import FormatError
from mawforge.trace.record import STEP_KINDS, Trace, TraceMeta, _block_table
from mawforge.trace.stats import format_stats, import_bmoe, layer_routes, routing_stats
from mawforge.trace.synthetic import SyntheticSpec, synthetic_trace

from helpers import run_cli


def _decode_trace(routes: list[list[int]], E: int = 8) -> Trace:
    """One layer, one decode step per row of `routes`."""
    k = len(routes[0])
    n = len(routes)
    return Trace(meta=TraceMeta(n_layers=1, n_experts=E, top_k=k, model="hand"), block_bytes=_block_table(4096, 1, E),
                 step_kind=np.full(n, STEP_KINDS.index("decode"), np.uint8), step_tokens=np.ones(n, np.int32),
                 rec_step=np.arange(n, dtype=np.int32), rec_layer=np.zeros(n, np.int32),
                 experts=np.asarray(routes, np.int32), weights=np.full((n, k), 1 / k, np.float32))


def test_hand_made_routes_give_the_counted_figures():
    routes = [[0, 1], [0, 2], [0, 1], [3, 4], [0, 1], [0, 1], [5, 6], [0, 7], [0, 1], [1, 2]]
    s = routing_stats(_decode_trace(routes), hot=0.25, budgets=())
    # lag 1: shared experts with the previous token over k, for tokens 1..9
    shared = [len(set(a) & set(b)) for a, b in zip(routes[1:], routes)]
    assert s["repeat_lag1"] == pytest.approx(sum(shared) / (2 * 9))
    assert s["repeat_lag8"] == pytest.approx((len({0, 1} & {0, 1}) + len({1, 2} & {0, 2})) / 4)
    last, dist = {}, []                                  # reuse distance: tokens since the expert's last routing
    for t, row in enumerate(routes):
        dist += [t - last[e] for e in row if e in last]
        last.update({e: t for e in row})
    assert dist[:4] == [1, 1, 2, 2] and s["reuse_distance"]["p50"] == np.median(dist)
    assert s["reuse_distance"]["p90"] == pytest.approx(np.quantile(dist, 0.9))
    assert s["first_routings"] == pytest.approx(8 / 20)             # experts 0..7 each routed first once
    counts = np.bincount(np.ravel(routes), minlength=8) / 20
    h = -(counts[counts > 0] * np.log2(counts[counts > 0])).sum() / 3
    assert s["entropy"] == pytest.approx(h)
    # hot set: the 2 hottest of the first 5 tokens are 0 and 1; they cover 6 of the last 10 routings
    assert s["hot_coverage"] == pytest.approx(6 / 10)
    assert "repeat at lag 1" in format_stats(s)


def test_reuse_in_a_synthetic_trace_shows_as_lag_one_repeat():
    def lag1(reuse):
        t = synthetic_trace(SyntheticSpec(n_layers=4, n_experts=64, top_k=4, prefill_tokens=16, decode_steps=300,
                                          zipf=0.5, reuse=reuse, seed=1))
        return routing_stats(t, budgets=())
    lo, hi = lag1(0.0), lag1(0.6)
    assert hi["repeat_lag1"] > lo["repeat_lag1"] + 0.4
    assert hi["reuse_distance"]["p50"] <= lo["reuse_distance"]["p50"]
    assert len(layer_routes(synthetic_trace(SyntheticSpec(n_layers=4, n_experts=64, top_k=4, prefill_tokens=16,
                                                          decode_steps=10)), "prefill")[0]) == 16


def test_hit_curves_run_the_replay_and_belady_bounds_them():
    t = synthetic_trace(SyntheticSpec(n_layers=4, n_experts=32, top_k=4, prefill_tokens=0, decode_steps=200,
                                      zipf=1.0, reuse=0.3, seed=2))
    s = routing_stats(t, budgets=("25%", "50%"))
    rate = {(r["budget"], r["policy"]): r["hit_rate"] for r in s["hit_curves"]}
    for b in ("25%", "50%"):
        assert rate[(b, "belady")] >= max(rate[(b, "lru")], rate[(b, "s3fifo")])
    assert rate[("50%", "lru")] > rate[("25%", "lru")]


BMOE = """# route_trace v1
# model=/data/q.gguf arch=qwen3moe n_layer=4 n_expert=8 n_expert_used=2
# layer=1 expert_bytes=1000 dense_bytes=50
# layer=3 expert_bytes=2000 dense_bytes=50
turn,phase,step,layer,slot,expert,weight,residency,expert_bytes,dropped
0,0,0,1,0,5,0.6,0,1000,0
0,0,0,1,1,2,0.4,0,1000,0
0,0,1,1,0,5,0.7,1,0,0
0,0,1,1,1,3,0.3,0,1000,0
0,0,1,3,0,1,0.5,0,2000,0
0,0,1,3,1,0,0.5,0,2000,0
0,1,2,1,0,5,0.5,1,0,0
0,1,2,1,1,3,0.5,1,0,0
0,1,2,3,0,1,nan,1,0,0
0,1,2,3,1,7,nan,0,2000,0
0,1,3,3,1,0,0.4,1,0,0
0,1,3,3,0,1,0.6,1,0,0
0,1,3,1,0,2,0.9,1,0,0
0,1,3,1,1,5,0.1,1,0,0
"""


def test_a_bigmoeonedge_route_trace_imports_with_its_documented_meaning(tmp_path):
    p = tmp_path / "q.route.csv"
    p.write_text(BMOE)
    t = import_bmoe(p)
    assert (t.meta.n_layers, t.meta.n_experts, t.meta.top_k) == (2, 8, 2)      # MoE layers 1, 3 -> 0, 1
    assert [STEP_KINDS[k] for k in t.step_kind] == ["prefill", "decode", "decode"]
    steps = list(t.steps())
    # prefill: layer 3 routed only the last prompt token (llama.cpp's inp_out_ids): left out of that step
    assert [layer for layer, _, _ in steps[0].layers] == [0] and steps[0].n_tokens == 2
    assert steps[0].layers[0][1].tolist() == [[5, 2], [5, 3]]
    # decode: slots in router order whatever the row order; nan weights become 1/k
    layer1 = dict((layer, (e, w)) for layer, e, w in steps[2].layers)
    assert layer1[1][0].tolist() == [[1, 0]] and layer1[0][0].tolist() == [[2, 5]]
    assert np.allclose(dict((layer, w) for layer, _, w in steps[1].layers)[1], 0.5)
    assert t.block_bytes[1, 0] == 2000 and t.block_bytes[0, 7] == 1000
    out = tmp_path / "q.npz"
    r = run_cli("trace", "import-bmoe", str(p), "-o", str(out))
    assert r.returncode == 0 and out.exists(), r.stderr
    r = run_cli("trace", "stats", str(out), "--json", "--budgets", "50%")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["tokens"] == 2 and s["repeat_lag1"] == pytest.approx((0.5 + 0.5) / 2)
    r = run_cli("trace", "stats", str(p))                                  # the CSV itself, read directly
    assert r.returncode == 0 and "seen within 8 tokens" in r.stdout and not math.isnan(len(r.stdout))


@pytest.mark.parametrize("text, match", [
    ("turn,phase\n0,0\n", "no '# route_trace v1' first line"),
    ("# route_trace v1\n# model=x n_layer=1 n_expert=4\nturn\n", "does not give n_expert_used"),
    ("# route_trace v1\n# n_layer=1 n_expert=4 n_expert_used=2\nturn,phase,step,layer,slot,expert\n0,1,0,0,0,1\n",
     "header lacks weight"),
    ("# route_trace v1\n# n_layer=1 n_expert=4 n_expert_used=2\nturn,phase,step,layer,slot,expert,weight\n"
     "0,1,0,0,0,9,0.5\n", "expert 9 out of range"),
    ("# route_trace v1\n# n_layer=1 n_expert=4 n_expert_used=2\nturn,phase,step,layer,slot,expert,weight\n"
     "0,1,0,0,0,1,0.5\n", "lacks some of its 2 slots"),
])
def test_a_bad_route_csv_is_one_line(tmp_path, text, match):
    p = tmp_path / "bad.csv"
    p.write_text(text)
    with pytest.raises(FormatError, match=match):
        import_bmoe(p)
    r = run_cli("trace", "stats", str(p))
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1
