"""`--prefetch auto`: the on/off governor, the rule that a prefetch spares the blocks about to be
used, and route traces that replay a run with auto prefetch and router lookahead exactly."""
from __future__ import annotations

import argparse
import dataclasses

import numpy as np
import pytest

from mawforge.cache.core import CacheCore
from mawforge.cache.driver import RouteDriver
from mawforge.cache.policies import make_policy
from mawforge.engine.generate import generate
from mawforge.engine.prefetch_auto import PrefetchGovernor
from mawforge.commands.run import make_recorder
from mawforge.engine.runtime import Runtime, RuntimeOptions
from mawforge.engine.sampling import SamplingParams
from mawforge.errors import FormatError, RequestError
from mawforge.trace.record import load_trace
from mawforge.trace.replay import LIVE_COUNTERS, live_check, replay_policy


def _feed(gov: PrefetchGovernor, seconds: dict, tokens: int, read_mb: float | None = None) -> list[bool]:
    """One-token steps at the given seconds a step per state (and MB read a step, if given)."""
    states = []
    for _ in range(tokens):
        on = gov.before_step()
        states.append(on)
        gov.after_step(on, 1, seconds["on" if on else "off"], None if read_mb is None else int(read_mb * 1e6))
    return states


def _drive(c, windows: int, seconds: dict) -> list:
    """An OnlineChooser of one-token windows through `windows` windows; the arms it ran."""
    seen = []
    for _ in range(windows):
        arm = c.mode()
        seen.append(arm)
        c.record(arm, 1, seconds[arm])
    return seen


def test_governor_turns_prefetch_off_when_it_loses_and_says_why():
    gov = PrefetchGovernor(window=2, probe_every=3)
    states = _feed(gov, {"on": 0.5, "off": 0.25}, 60)      # prefetch on: 2 tok/s, off: 4 tok/s
    rep = gov.report()
    assert rep["mode"] == "auto" and rep["tok_s"]["on"] == pytest.approx(2.0) \
        and rep["tok_s"]["off"] == pytest.approx(4.0)
    assert all(states[:6]) and states[6:8] == [False, False]  # on is the prior: off explored after 3 windows
    assert sum(states[10:]) < sum(not s for s in states[10:])  # mostly off once measured
    assert any(s for s in states[10:])                       # but keeps re-probing on
    reasons = [s["why"] for s in rep["recent_switches"] if s["to"] == "off"]
    assert reasons and any(r.startswith("faster: off 4 tok/s against on 2") for r in reasons)
    assert rep["switches"] >= 3


def test_governor_keeps_prefetch_on_when_it_wins():
    gov = PrefetchGovernor(window=2, probe_every=3)
    states = _feed(gov, {"on": 0.2, "off": 0.4}, 60)
    assert gov.report()["state"] == "on" or gov.report()["recent_switches"][-1]["why"].startswith("probe")
    assert sum(states[10:]) > sum(not s for s in states[10:])


def test_a_change_of_phase_measures_both_states_again():
    """Teacher-forced tokens read much and prefetch wins; then greedy text reads little and off
    wins: the drop in reads a token re-measures off at once, not at the next probe 8+ windows on."""
    gov = PrefetchGovernor(window=2, probe_every=3, max_probe_every=64)
    heavy, light = {"on": 0.25, "off": 0.35}, {"on": 0.15, "off": 0.12}
    first = _feed(gov, heavy, 60, 200)                          # prefetch wins while reads are heavy
    assert gov.report()["state"] == "on" and sum(first[20:]) >= 36 and gov.phases == 0
    later = _feed(gov, light, 8, 10)                            # a 20x drop in reads: off wins now
    rep = gov.report()
    assert gov.phases == 1 and later[:2] == [True, True] and not any(later[2:])   # off from the next window on
    assert rep["tok_s"]["off"] == pytest.approx(1 / 0.12)      # measured afresh, not averaged with the old phase
    assert any(s["why"].startswith("phase: expert reads 200 -> 10 MB a token") for s in rep["recent_switches"])
    for _ in range(3):          # requests whose first window (just after the prompt) reads more: no new phase
        gov.new_request()
        _feed(gov, light, 2, 70)
        _feed(gov, light, 4, 10)
    assert gov.phases == 1
    # the same change without read figures waits for the next probe of off
    blind = PrefetchGovernor(window=2, probe_every=3, max_probe_every=64)
    _feed(blind, heavy, 60)
    _feed(blind, light, 8)
    assert blind.report()["state"] == "on" and blind.phases == 0


def test_the_first_arm_is_a_prior_with_explore_after():
    from mawforge.engine.online import OnlineChooser
    c = OnlineChooser(("on", "off"), window=1, probe_every=2, explore_after=3)
    seen = _drive(c, 6, {"on": 0.1, "off": 0.2})
    assert seen[:4] == ["on", "on", "on", "off"] and c.rate["off"] == pytest.approx(5.0)


def test_probes_of_a_losing_state_grow_rarer_while_it_keeps_losing():
    from mawforge.engine.online import OnlineChooser
    c = OnlineChooser(("on", "off"), window=1, probe_every=2, max_probe_every=8)
    seen = _drive(c, 60, {"on": 0.1, "off": 0.2})
    offs = [i for i, a in enumerate(seen) if a == "off"]
    gaps = [b - a for a, b in zip(offs, offs[1:])]
    assert offs[0] == 1                                    # explored right after the first window
    assert gaps[:4] == [2, 4, 8, 8] and set(gaps[2:]) == {8}   # a probe every 2, 4, then 8 windows at most
    assert c.interval == 8
    c.reprobe()                                            # a new phase: the first interval again
    assert c.interval == 2
    # a probe that changes the choice restores the first interval too
    c = OnlineChooser(("on", "off"), window=1, probe_every=2, max_probe_every=8)
    for i in range(40):
        arm = c.mode()
        c.record(arm, 1, (0.1 if arm == "on" else 0.2) if i < 20 else (0.3 if arm == "on" else 0.2))
    assert c.mode() == "off" or c.interval == 2
    with pytest.raises(ValueError):
        OnlineChooser(("on", "off"), probe_every=4, max_probe_every=2)


def test_prefetch_choice_outlives_a_request_and_threads_are_measured_afresh(packs):
    rt = Runtime(packs[("qwen3_moe", "Q4_K_M")], RuntimeOptions(context=320, prefill_chunk=16, expert_cache_percent=40))
    try:
        pc, tc = rt.prefetch_governor.chooser, (rt.governor.chooser if rt.governor is not None else None)
        for arm, secs in (("on", 0.1), ("off", 0.2)):
            pc.record(arm, pc.window, secs * pc.window)
        if tc is not None:
            for arm in tc.arms:
                tc.record(arm, tc.window, 0.1 * tc.window)
        rt.reset()
        assert pc._queue == [] and pc.mode() == "on"           # prefetch: no re-measuring of "off"
        if tc is not None:
            assert tc._queue                                   # threads: the others measured again
    finally:
        rt.close()


def test_a_prefetch_spares_the_blocks_about_to_be_used():
    B = 100
    core = CacheCore(3 * B, make_policy("lru"))
    driver = RouteDriver(core, lambda layer, e: B)
    for key in ((0, 5), (1, 0), (3, 7)):
        core.access(key, B)
    # a lookahead for layer 1 (issued before layer 0 runs) makes room with layer 3's block,
    # never with layer 0's or layer 1's
    plan = driver.lookahead([(1, 2)])
    assert plan.loads == ((1, 2),) and plan.evicted == ((3, 7),)
    # now only blocks of layers 0 and 1 remain: the next lookahead is dropped, nothing evicted
    plan = driver.lookahead([(1, 3)])
    assert plan.loads == () and plan.evicted == ()
    assert set(core.resident()) == {(0, 5), (1, 0), (1, 2)}
    s = core.stats()
    assert s.prefetch_dropped == 1 and s.prefetch_spared == 1
    # a prefetch issued after layer 0 ran spares only layer 1: layer 0's block makes room
    plan = driver.prefetch([(1, 3)])
    assert plan.loads == ((1, 3),) and plan.evicted == ((0, 5),)
    # a demand access still evicts as before (LRU: the oldest)
    hit, gone = core.access((2, 1), B)
    assert not hit and gone == [(1, 0)]


def test_a_lookahead_two_layers_ahead_spares_every_layer_up_to_it():
    B = 100
    core = CacheCore(4 * B, make_policy("lru"))
    driver = RouteDriver(core, lambda layer, e: B)
    driver.begin_step("decode", 1)
    for key in ((3, 1), (1, 0), (2, 4), (5, 5)):
        core.access(key, B)
    list(driver.layer(0, np.array([[7]]), np.array([[1.0]])))     # layer 0 computed: (3, 1) evicted
    assert driver.next_layer == 1 and (3, 1) not in core
    # issued before layer 1's experts, for layers 2 and 3: layer 1's and 2's blocks are spared,
    # so the room comes from layer 5's and then layer 0's, the oldest outside [1, 3]
    plan = driver.lookahead([(2, 6), (3, 2)])
    assert plan.loads == ((2, 6), (3, 2)) and plan.evicted == ((5, 5), (0, 7))
    # nothing outside [1, 3] is left: a further load is dropped, evicting nothing
    plan = driver.lookahead([(3, 3)])
    assert plan.loads == () and plan.evicted == () and core.stats().prefetch_spared == 1
    driver.begin_step("decode", 1)                                 # a new step starts at layer 0
    assert driver.next_layer == 0


def test_a_miss_spares_prefetched_blocks_of_its_layer_and_later_ones_while_it_can():
    B = 100
    core = CacheCore(3 * B, make_policy("lru"))
    assert core.prefetch((2, 5), B) == ("load", [])          # the oldest block: a prefetch, not yet used
    for key in ((0, 1), (0, 2)):
        core.access(key, B)
    hit, gone = core.access((1, 3), B)                       # LRU would take (2, 5): layer 2 comes later
    assert not hit and gone == [(0, 1)]
    hit, gone = core.access((3, 0), B)                       # (2, 5) is for an earlier layer now: taken
    assert not hit and gone == [(2, 5)] and core.stats().prefetch_wasted == 1
    core = CacheCore(2 * B, make_policy("lru"))
    for key in ((2, 5), (3, 6)):
        core.prefetch(key, B)
    hit, gone = core.access((1, 0), B)                       # only spared blocks left: the policy's victim
    assert gone == [(2, 5)] and core.stats().prefetch_spared == 0


def test_a_demand_read_goes_before_queued_prefetches():
    import threading
    from mawforge.cache.store import ReadPool
    pool = ReadPool(1)
    gate, started, order = threading.Event(), threading.Event(), []
    first = pool.submit(lambda: (started.set(), gate.wait(5), order.append("running"))[2])
    assert started.wait(5)                   # the one reader is busy: what follows queues
    later = [pool.submit(order.append, f"prefetch {i}") for i in range(3)]
    miss = pool.submit(order.append, "demand", demand=True)
    bad = pool.submit(lambda: 1 / 0)
    gate.set()
    for f in (first, *later, miss):
        f.result(5)
    assert order == ["running", "demand", "prefetch 0", "prefetch 1", "prefetch 2"]
    with pytest.raises(ZeroDivisionError):
        bad.result(5)
    pool.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(order.append, "late")


def test_a_disabled_driver_issues_no_prefetch():
    core = CacheCore(4 * 100, make_policy("lru"))
    from mawforge.cache.prefetchers import make_prefetcher
    driver = RouteDriver(core, lambda layer, e: 100, make_prefetcher("confidence:0.2"))
    driver.begin_step("decode", 1)
    list(driver.layer(0, np.array([[1, 2]]), np.array([[0.6, 0.4]])))
    list(driver.layer(1, np.array([[3, 4]]), np.array([[0.7, 0.3]])))
    driver.enabled = False
    assert not driver.begin_step("decode", 1) and not driver.after_layer(0)
    driver.enabled = True
    assert driver.after_layer(0).loads == () and set(driver.after_layer(0).probed) == {(1, 3), (1, 4)}


@pytest.fixture(scope="module")
def auto_run(packs, tmp_path_factory):
    """A greedy run with auto prefetch at 40% cache, the governor's windows shortened so that it
    switches prefetch on and off within the run, recorded to a route trace."""
    pack = packs[("qwen3_moe", "Q4_K_M")]
    path = tmp_path_factory.mktemp("auto") / "trace.npz"
    recorder = make_recorder(argparse.Namespace(trace_out=str(path), pack=pack))
    rt = Runtime(pack, RuntimeOptions(context=320, prefill_chunk=16, expert_cache_percent=40), recorder)
    assert rt.prefetch_governor is not None and rt.lookahead      # auto is the default
    rt.prefetch_governor = PrefetchGovernor(window=1, probe_every=2)
    try:
        ids = rt.tokenizer.encode("The expert cache keeps what the router asks for")
        evs = list(generate(rt, ids, SamplingParams(max_tokens=32, ignore_eos=True)))
        recorder.set_live(rt.plan.E, rt.opts.policy, rt.prefetch_spec, rt.cache.core.stats())
        recorder.save(path)
        stats = rt.cache.stats()
    finally:
        rt.close()
    plain = Runtime(pack, RuntimeOptions(context=320, prefill_chunk=16, expert_cache_percent=40, prefetch="none"))
    try:
        want = [e.token for e in generate(plain, ids, SamplingParams(max_tokens=32, ignore_eos=True))]
    finally:
        plain.close()
    return dict(path=path, tokens=[e.token for e in evs], want=want, telemetry=evs[-1].telemetry, stats=stats)


def test_auto_prefetch_is_transparent_and_reported(auto_run):
    assert auto_run["tokens"] == auto_run["want"]
    rep = auto_run["telemetry"].prefetch
    assert rep["mode"] == "auto" and rep["lookahead"] and rep["switches"] >= 1
    assert rep["windows"]["on"] >= 1 and rep["windows"]["off"] >= 1
    s = auto_run["stats"]
    assert s["prefetch_issued"] > 0
    assert s["prefetch_issued_bytes"] == \
        s["prefetch_useful_bytes"] + s["prefetch_wasted_bytes"] + s["prefetch_pending_bytes"]


def test_trace_of_an_auto_run_replays_its_live_counters_exactly(auto_run):
    trace = load_trace(auto_run["path"])
    assert trace.has_live_prefetch
    assert set(trace.step_prefetch.tolist()) == {0, 1}           # both states were recorded
    assert len(trace.la_step) > 0 and len(trace.la_keys) > 0     # and the lookahead prefetches
    check = live_check(trace)
    assert check["match"], check
    # the recorded decisions matter: replaying the routing alone gives other counters
    live = trace.meta.live
    alone = replay_policy(trace, live["capacity_bytes"], live["policy"], live["prefetch"]).to_dict()
    assert {k: alone[k] for k in LIVE_COUNTERS} != check["recorded"]
    # `--prefetch live` replays those decisions for any policy: the recorded policy gives the live
    # counters; another policy gets the same lookahead prefetches (the router's picks) at the same points
    again = replay_policy(trace, live["capacity_bytes"], live["policy"], "live").to_dict()
    assert {k: again[k] for k in LIVE_COUNTERS} == check["recorded"]
    other = replay_policy(trace, live["capacity_bytes"], "lru", "live")
    assert other.prefetch_issued + other.prefetch_probes > 0


def test_replay_with_live_prefetch_from_the_cli(auto_run, tmp_path, capsys):
    from mawforge.trace.replay import add_arguments, main as replay_main
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    cap = load_trace(auto_run["path"]).meta.live["capacity_bytes"]
    a = ap.parse_args([str(auto_run["path"]), "--budgets", f"{cap}B", "--policies", "s3fifo,s3fifo-classic",
                       "--prefetch", "none,live", "-o", str(tmp_path / "out"), "--no-plots"])
    assert replay_main(a) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "hit rate" in line]
    assert len(lines) == 4 and all(" live " in line or " none " in line for line in lines)
    assert all("read " in line and line.rstrip().endswith("GB") for line in lines)


def test_damaged_prefetch_arrays_are_format_errors(auto_run, tmp_path):
    trace = load_trace(auto_run["path"])
    bad_keys = trace.la_keys.copy()
    bad_keys[0, 1] = 10_000
    cases = {
        "out of range": dict(la_keys=bad_keys),
        "all or none": dict(la_step=None),
        "step_prefetch": dict(step_prefetch=np.full_like(trace.step_prefetch, 2)),
        "record position": dict(la_rec=trace.la_rec + 1000),
        "cover": dict(la_start=trace.la_start[:-1]),
    }
    for why, change in cases.items():
        fields = {f.name: getattr(trace, f.name) for f in dataclasses.fields(trace) if f.init}
        fields.update(change)
        with pytest.raises(FormatError, match="bad trace"):
            type(trace)(**fields)
    # a trace from before auto prefetch (no such arrays) still loads, and replays on routing alone
    fields = {f.name: getattr(trace, f.name) for f in dataclasses.fields(trace) if f.init}
    for name in ("step_prefetch", "la_step", "la_rec", "la_start", "la_keys"):
        fields[name] = None
    old = type(trace)(**fields).save(tmp_path / "old.npz")
    assert not load_trace(old).has_live_prefetch
    with pytest.raises(RequestError, match="prefetch live needs a trace recorded with prefetch"):
        replay_policy(load_trace(old), 10**9, "s3fifo", "live")


def test_thread_governor_says_when_a_step_is_safe_to_time():
    from mawforge.engine.threads import ThreadGovernor
    gov = ThreadGovernor(2, window=1, probe_every=2)
    c = gov.chooser
    assert not gov.settled()                       # nothing measured yet
    c.record(2, 1, 0.5)                            # 2 threads: 2 tok/s; next explores 1
    assert c.current == 1 and not gov.settled()
    c.record(1, 1, 1.0)                            # 1 thread: 1 tok/s; back to the best
    assert c.current == 2 and gov.settled()
    c.record(2, 1, 0.5)                            # the next window probes 1 thread
    assert c.current == 1 and not gov.settled()


def test_a_new_request_remeasures_the_other_choices():
    from mawforge.engine.online import OnlineChooser
    c = OnlineChooser((2, 1), window=1, probe_every=100)
    c.reprobe()                                     # still exploring: nothing queued
    c.record(2, 1, 1.0)                             # 2 threads: 1 tok/s (a read-heavy phase)
    c.record(1, 1, 0.5)                             # 1 thread: 2 tok/s
    assert c.current == 1
    c.record(1, 1, 0.5)
    assert c.current == 1                           # probes are 100 windows apart
    c.reprobe()                                     # a new request: measure 2 threads again soon
    c.record(1, 1, 0.5)
    assert c.current == 2
    c.record(2, 1, 0.1)                             # now 10 tok/s: EMA (1 + 10) / 2 = 5.5 > 2
    assert c.current == 2 and c.rate[2] == pytest.approx(5.5)
