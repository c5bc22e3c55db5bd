"""Route traces, the Belady oracles, the synthetic generator and the replay CLI."""

import argparse
import csv
import json

import numpy as np
import pytest

from mawforge.cache.core import CacheCore
from mawforge.cache.driver import RouteDriver
from mawforge.cache.policies import make_policy
from mawforge.cache.prefetchers import make_prefetcher
from mawforge.errors import FormatError, RequestError
from mawforge.trace import replay as replay_cli
from mawforge.trace import synthetic
from mawforge.trace.oracle import access_sequence, belady
from mawforge.trace.record import TraceRecorder, load_trace
from mawforge.trace.replay import live_check, parse_budget, replay, replay_policy, summarize

B = 100


def tiny_trace(steps, n_layers=1, n_experts=8, top_k=2, block_bytes=B):
    """steps: list of (kind, {layer: experts [T, k]}) with weights falling by position."""
    rec = TraceRecorder(n_layers=n_layers, n_experts=n_experts, top_k=top_k,
                        block_bytes=block_bytes, model="tiny")
    for kind, layers in steps:
        first = next(iter(layers.values()))
        rec.begin_step(kind, len(first))
        for layer, ex in layers.items():
            w = np.tile(np.linspace(1, 0.5, top_k), (len(ex), 1))
            rec.record(layer, np.asarray(ex), w / w.sum(axis=1, keepdims=True))
    return rec.to_trace()


def decode_steps(*rows):
    return [("decode", {0: [list(r)]}) for r in rows]


def test_oracles_by_hand_on_single_access_steps():
    # top-1 steps 1 1 2 3 2 4 1 3, capacity 3 blocks. Farthest next use: at 4, blocks
    # 1 (next at 6), 2 (never), 3 (next at 7) -> evict 2; everything after hits.
    trace = tiny_trace(decode_steps(*[[e] for e in [1, 1, 2, 3, 2, 4, 1, 3]]), top_k=1)
    seq = access_sequence(trace)
    for pinned in (False, True):  # one-block groups: pins change nothing
        s = belady(seq, 3 * B, pinned)
        assert (s.hits, s.misses, s.evictions) == (4, 4, 1)
    assert replay_policy(trace, 3 * B, "lru").hits == 2  # same as tests/test_policies.py


def test_pins_cost_the_oracle_hits_by_hand():
    # groups {1,2} {1,3} {2,4}, capacity 2 blocks.
    # relaxed: 3 evicts 1 (never used again, 2 is), 4 evicts 2 (tie: smaller key) -> 2 hits
    # pinned: 3 must evict 2 (1 is pinned), 2 evicts 1, 4 evicts 3 -> 1 hit
    trace = tiny_trace(decode_steps([1, 2], [3, 1], [2, 4]))
    seq = access_sequence(trace)
    assert seq.keys.tolist() == [1, 2, 1, 3, 2, 4]
    relaxed, pinned = belady(seq, 2 * B, False), belady(seq, 2 * B, True)
    assert (relaxed.hits, relaxed.misses, relaxed.evictions) == (2, 4, 2)
    assert (pinned.hits, pinned.misses, pinned.evictions) == (1, 5, 3)
    lru = replay_policy(trace, 2 * B, "lru")  # 3 evicts 2, then 2 evicts 1, 4 evicts 3
    assert (lru.hits, lru.misses, lru.evictions) == (1, 5, 3)


def test_oracle_bounds_every_policy_on_synthetic_trace():
    trace = synthetic.generate(3, 16, 2, 150, zipf=0.8, reuse=0.2, seed=1)
    seq = access_sequence(trace)
    cap = 12 << 20
    floor = belady(seq, cap, False).misses
    assert belady(seq, cap, True).misses >= floor
    for policy in ("lru", "lfu", "fifo", "random:0", "s3fifo"):
        assert replay_policy(trace, cap, policy).misses >= floor


def test_mixed_sizes_oracle_is_labelled_a_reference():
    # sizes 1:200 2:100 3:300 4:50, capacity 600; 4 needs 50 bytes: evict 2 (never used
    # again) before 1 and 3 -> both hit at the end
    sizes = [[100, 200, 100, 300, 50, 50, 50, 50]]
    trace = tiny_trace(decode_steps([1, 2], [3, 4], [1, 3]), block_bytes=sizes)
    rows = replay(trace, ["600"], ["belady", "belady-pinned"])
    assert all("not a bound" in r["note"] for r in rows)
    assert [(r["hits"], r["misses"], r["materialized_bytes"]) for r in rows] == [(2, 4, 650)] * 2


def test_replay_reproduces_live_counts_exactly(tmp_path):
    """A live-style run (recorder + driver on the same arrays) against replay of the file."""
    spec = synthetic.SyntheticSpec(n_layers=3, n_experts=12, top_k=3, decode_steps=40,
                                   prefill_tokens=6, reuse=0.3, block_bytes=(B, 2 * B, B), seed=4)
    source = synthetic.synthetic_trace(spec)
    for policy, prefetch in [("lru", None), ("random:2", "confidence:0.2"), ("s3fifo", "preserve:0.2")]:
        rec = TraceRecorder(n_layers=3, n_experts=12, top_k=3, block_bytes=[B, 2 * B, B])
        core = CacheCore(1400, make_policy(policy))
        drv = RouteDriver(core, lambda layer, e: (B, 2 * B, B)[layer], make_prefetcher(prefetch), n_experts=12)
        for step in source.steps():
            rec.begin_step(step.kind, step.n_tokens)
            drv.begin_step(step.kind, step.n_tokens)
            for layer, ex, w in step.layers:
                rec.record(layer, ex, w)
                for _ in drv.layer(layer, ex, w):
                    pass
                drv.after_layer(layer)
            drv.end_step()
        rec.set_live(1400, policy, prefetch, core.stats())
        path = rec.save(tmp_path / f"{policy}.npz")
        assert replay_policy(load_trace(path), 1400, policy, prefetch) == core.stats()
        assert live_check(load_trace(path))["match"]
    # A trace whose live counters disagree with replay fails the CLI's live check.
    rec.set_live(1400, policy, prefetch, {**core.stats().to_dict(), "hits": core.stats().hits + 1})
    rec.save(tmp_path / "bad.npz")
    args = parse(replay_cli, [str(tmp_path / "bad.npz"), "--budgets", "50%", "--policies", "lru",
                              "--no-plots", "-o", str(tmp_path / "out")])
    assert replay_cli.main(args) == 1
    assert "MISMATCH" in (tmp_path / "out" / "report.md").read_text()


def test_trace_roundtrip_and_metadata(tmp_path):
    trace = synthetic.generate(2, 8, 2, 5, prefill_tokens=3)
    loaded = load_trace(trace.save(tmp_path / "t.npz"))
    assert loaded.meta == trace.meta and loaded.meta.synthetic and loaded.meta.label == "SYNTHETIC"
    assert np.array_equal(loaded.experts, trace.experts)
    assert np.array_equal(loaded.weights, trace.weights)
    steps = list(loaded.steps())
    assert [(s.kind, s.n_tokens) for s in steps] == [("prefill", 3)] + [("decode", 1)] * 5
    assert steps[0].layers[1][1].shape == (3, 2)


def test_garbage_and_damaged_traces_are_format_errors(tmp_path):
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not a zip file at all")
    with pytest.raises(FormatError, match="not a readable trace"):
        load_trace(junk)
    with pytest.raises(FormatError, match="does not exist"):
        load_trace(tmp_path / "missing.npz")
    np.savez(tmp_path / "other.npz", x=np.zeros(3))
    with pytest.raises(FormatError, match="missing"):
        load_trace(tmp_path / "other.npz")
    trace = synthetic.generate(2, 8, 2, 5)
    with np.load(trace.save(tmp_path / "t.npz")) as z:
        arrays = dict(z)
    arrays["experts"] = arrays["experts"] + 8  # ids past n_experts
    np.savez(tmp_path / "bad.npz", **arrays)
    with pytest.raises(FormatError, match="expert id out of range"):
        load_trace(tmp_path / "bad.npz")


def test_recorder_checks_its_input():
    rec = TraceRecorder(n_layers=2, n_experts=4, top_k=2, block_bytes=B)
    with pytest.raises(ValueError):
        rec.record(0, [[1, 2]], [[0.5, 0.5]])
    rec.begin_step("decode", 1)
    with pytest.raises(ValueError):
        rec.record(0, [[1, 2], [2, 3]], [[0.5, 0.5], [0.5, 0.5]])
    with pytest.raises(ValueError):
        rec.begin_step("train", 1)


def lru_hit_rate(**kwargs):
    trace = synthetic.generate(4, 32, 2, 300, seed=3, **kwargs)
    return replay_policy(trace, trace.total_expert_bytes // 4, "lru").hit_rate


def test_synthetic_locality_knobs_move_hit_rate():
    assert lru_hit_rate(zipf=1.5) > lru_hit_rate(zipf=0.0) + 0.1
    assert lru_hit_rate(zipf=0.5, reuse=0.8) > lru_hit_rate(zipf=0.5, reuse=0.0) + 0.1
    with pytest.raises(RequestError):
        synthetic.SyntheticSpec(reuse=1.5)


def test_budget_parsing():
    total = 1 << 30
    assert parse_budget("25%", total).capacity_bytes == 1 << 28
    assert parse_budget("512MiB", total).capacity_bytes == 512 << 20
    assert parse_budget("512MiB", total).percent == 50.0
    assert parse_budget("1000", total).capacity_bytes == 1000
    for bad in ("lots", "12XB", "0%"):
        with pytest.raises(RequestError):
            parse_budget(bad, total)


def test_replay_grid_rejects_small_budgets_and_spreads_random_seeds():
    trace = synthetic.generate(2, 8, 2, 30)
    rows = replay(trace, ["1%", "50%"], ["lru", "random", "belady"], seeds=[0, 1, 2])
    assert len(rows) == 2 * 5
    small = [r for r in rows if r["budget"] == "1%"]
    assert all(r["status"] == "rejected" and "minimum" in r["note"] for r in small)
    summary = {(s["budget"], s["policy"]): s for s in summarize(rows)}
    assert summary[("50%", "random")]["runs"] == 3
    lru = summary[("50%", "lru")]
    assert lru["regret_belady"] >= 0 and lru["extra_misses_belady"] >= 0


def parse(module, argv):
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(argv)


def test_replay_cli_end_to_end(tmp_path, capsys):
    trace_path = tmp_path / "synth.npz"
    assert synthetic.main(parse(synthetic, ["-o", str(trace_path), "--layers", "3", "--experts", "16",
                                            "--decode-steps", "40", "--prefill-tokens", "8",
                                            "--zipf", "1.0,0.5,0.0", "--block-bytes", "100,200,100"])) == 0
    out = tmp_path / "out"
    args = parse(replay_cli, [str(trace_path), "--budgets", "30%,60%,100", "--seeds", "0,1",
                              "--prefetch", "none,confidence-prefill:0.2", "-o", str(out)])
    assert replay_cli.main(args) == 0
    assert "SYNTHETIC" in capsys.readouterr().out
    with open(out / "replay.csv") as f:
        rows = list(csv.DictReader(f))
    doc = json.loads((out / "replay.json").read_text())
    assert len(rows) == len(doc["rows"]) > 0 and doc["label"] == "SYNTHETIC"
    assert {r["status"] for r in rows} == {"ok", "rejected"}
    report = (out / "report.md").read_text()
    assert "SYNTHETIC" in report and "## Regret vs belady-pinned" in report
    for png in ("hit_rate.png", "regret.png", "reuse_distance.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"


def test_route_trace_of_a_layer_major_prompt_replays_live_counts_exactly(tmp_path_factory):
    """A prompt of six chunks run in waves (two chunks each, layer by layer, auto prefetch's router
    lookahead over all of a wave's tokens) inside a cache that evicts: each wave is one prefill
    step of its tokens in the trace, and replay reproduces the live counters exactly."""
    from helpers import dashboard_pack
    from mawforge.engine.generate import generate
    from mawforge.commands.run import make_recorder
    from mawforge.engine.runtime import Runtime, RuntimeOptions
    from mawforge.engine.sampling import SamplingParams
    root = tmp_path_factory.mktemp("wave-trace")
    pack, path = dashboard_pack(root), root / "trace.npz"
    recorder = make_recorder(argparse.Namespace(trace_out=str(path), pack=pack))
    rt = Runtime(pack, RuntimeOptions(context=256, prefill_chunk=16, prefill_wave=32, expert_cache_percent=30,
                                      threads=1), recorder)
    try:
        prompt = [3 + (i * 37) % 1900 for i in range(96)]
        list(generate(rt, prompt, SamplingParams(max_tokens=8, ignore_eos=True)))
        recorder.set_live(rt.plan.E, rt.opts.policy, rt.prefetch_spec, rt.cache.core.stats())
        recorder.save(path)
    finally:
        rt.close()
    trace = load_trace(path)
    steps = [(s.kind, s.n_tokens) for s in trace.steps()]
    assert steps == [("prefill", 32)] * 3 + [("decode", 1)] * 7
    assert trace.has_live_prefetch and len(trace.la_step) > 0       # lookahead ran inside the waves
    check = live_check(trace)
    assert check["match"], check
