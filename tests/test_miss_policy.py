"""Lossy miss policies (models/miss_policy.py): what each does to one layer's routing, that they stay
out of prefill and out of the default, that their counters reach the telemetry and the server's
metrics, and that a lossy run's route trace replays its own counters."""
from __future__ import annotations

import argparse

import numpy as np
import pytest

from mawforge.commands.run import make_recorder
from mawforge.demo import DEMO_DIR
from mawforge.engine.generate import generate
from mawforge.engine.options import RuntimeOptions
from mawforge.engine.runtime import Runtime
from mawforge.engine.sampling import SamplingParams
from mawforge.errors import RequestError
from mawforge.models.miss_policy import SKIPPED, MissPolicy
from mawforge.serve.worker import Ledger
from mawforge.trace.record import load_trace
from mawforge.trace.replay import live_check
from mawforge.trace.stats import routing_stats

PACK = DEMO_DIR / "mawforge-demo-qwen3moe-Q4_K_M.exact.pack"
PROMPT = "The LORD is my shepherd; I shall not want. He maketh me to lie down in green pastures."

IDX = np.array([[3, 7, 1, 9]])
W = np.array([[0.5, 0.3, 0.15, 0.05]], np.float32)


def resident_of(*keys):
    held = set(keys)
    return lambda key: key in held


def test_exact_returns_the_routing_untouched():
    i, w = MissPolicy().apply(0, IDX, W, resident_of(), lambda: pytest.fail("no logits asked"), True)
    assert i is IDX and w is W


def test_skip_drops_low_weight_misses_keeps_resident_and_strong_ones_and_renormalizes():
    p = MissPolicy("skip", 0.2)
    i, w = p.apply(2, IDX, W, resident_of((2, 3), (2, 1)), None, renorm=True)
    # 9 (0.05, missed) skipped; 1 (0.15) resident stays; 7 (0.3) above the threshold stays; 3 resident
    assert i.tolist() == [[3, 7, 1, SKIPPED]]
    np.testing.assert_allclose(w[0, :3], W[0, :3] / W[0, :3].sum(), rtol=1e-6)
    assert w[0, 3] == 0 and p.counts == {"substituted": 0, "skipped": 1}
    assert IDX.tolist() == [[3, 7, 1, 9]] and W[0, 3] == np.float32(0.05)      # inputs not written


def test_skip_without_renormalization_keeps_the_survivors_weights():
    i, w = MissPolicy("skip", 1.0).apply(0, IDX, W, resident_of(), None, renorm=False)
    assert i.tolist() == [[3, SKIPPED, SKIPPED, SKIPPED]]         # the strongest expert is always kept
    assert w.tolist() == [[0.5, 0.0, 0.0, 0.0]]


def test_substitute_takes_the_best_resident_expert_not_already_chosen_at_the_missed_weight():
    logits = np.zeros((1, 12))
    logits[0, [3, 5, 6, 10]] = [9.0, 4.0, 6.0, 5.0]         # 3 is chosen already; 6 ranks above 10 and 5
    p = MissPolicy("substitute", 0.1)
    i, w = p.apply(1, IDX, W, resident_of((1, 3), (1, 7), (1, 1), (1, 5), (1, 10), (1, 6)), lambda: logits, True)
    assert i.tolist() == [[3, 7, 1, 6]] and w.tolist() == W.tolist()
    assert p.counts["substituted"] == 1
    # nothing resident to substitute with: the miss is read
    i, _ = MissPolicy("substitute", 1.0).apply(1, IDX, W, resident_of(), lambda: logits, True)
    assert i.tolist() == IDX.tolist()


@pytest.mark.parametrize("spec", ["fast", "skip:x", "skip:0", "skip:1.5", "exact:0.1", "substitute:-1"])
def test_bad_specs_are_one_line_errors_before_anything_loads(spec):
    with pytest.raises(RequestError):
        RuntimeOptions(miss_policy=spec)


def test_parse_and_report():
    p = MissPolicy.parse("Skip:0.05")
    assert (p.mode, p.threshold, p.spec()) == ("skip", 0.05, "skip:0.05")
    assert MissPolicy.parse(None).spec() == "exact" and not MissPolicy.parse("exact").lossy
    assert MissPolicy.parse("substitute").threshold == 0.1


def _run(policy: str, recorder=None, n: int = 24):
    rt = Runtime(PACK, RuntimeOptions(context=256, expert_cache_percent=25, default_budget=False,
                                      miss_policy=policy, prefetch="none"), recorder=recorder)
    try:
        evs = list(generate(rt, rt.tokenizer.encode(PROMPT),
                            SamplingParams(max_tokens=n, ignore_eos=True, temperature=0)))
        return evs, rt
    finally:
        rt.close()


def test_lossy_decode_reads_less_counts_what_it_did_and_keeps_prefill_exact():
    exact, rt_exact = _run("exact")
    skip, rt_skip = _run("skip:1")
    sub, rt_sub = _run("substitute:1")
    t_exact, t_skip, t_sub = (evs[-1].telemetry for evs in (exact, skip, sub))
    assert t_exact.miss_policy == {"mode": "exact", "threshold": None, "substituted": 0, "skipped": 0}
    assert t_skip.miss_policy["skipped"] > 0 and t_skip.miss_policy["substituted"] == 0
    assert t_sub.miss_policy["substituted"] > 0 and t_sub.miss_policy["skipped"] == 0
    assert t_skip.materialized_bytes < t_exact.materialized_bytes
    assert t_sub.materialized_bytes < t_exact.materialized_bytes
    # the first token comes from the prompt's logits: prefill is exact under every policy
    assert exact[0].token == skip[0].token == sub[0].token
    assert exact[0].logprob == pytest.approx(skip[0].logprob) and exact[0].logprob == pytest.approx(sub[0].logprob)


def test_exact_policy_under_a_small_cache_gives_the_full_cache_tokens():
    small, _ = _run("exact")
    rt = Runtime(PACK, RuntimeOptions(context=256, expert_cache_percent=100, default_budget=False))
    try:
        full = list(generate(rt, rt.tokenizer.encode(PROMPT), SamplingParams(max_tokens=24, ignore_eos=True,
                                                                              temperature=0)))
    finally:
        rt.close()
    assert [e.token for e in small] == [e.token for e in full]


def test_a_lossy_runs_trace_records_skips_and_replays_its_own_counters(tmp_path):
    path = tmp_path / "skip.npz"
    recorder = make_recorder(argparse.Namespace(trace_out=str(path), pack=PACK))
    evs, rt = _run("skip:1", recorder=recorder, n=32)
    recorder.set_live(rt.plan.E, rt.opts.policy, rt.prefetch_spec, rt.cache.core.stats())
    recorder.save(path)
    trace = load_trace(path)
    assert (trace.experts == SKIPPED).sum() == evs[-1].telemetry.miss_policy["skipped"]
    assert live_check(trace)["match"]
    stats = routing_stats(trace)
    assert 0 < stats["repeat_lag1"] <= 1 and stats["entropy"] > 0


def test_the_servers_ledger_sums_substituted_and_skipped_experts():
    evs, _ = _run("skip:1", n=8)
    tele = evs[-1].telemetry.to_dict()
    led = Ledger()
    led.record("r1", "/v1/completions", 200, tele)
    led.record("r2", "/v1/completions", 200, tele)
    assert led.totals["skipped_experts"] == 2 * tele["miss_policy"]["skipped"] > 0
    assert led.totals["substituted_experts"] == 0
