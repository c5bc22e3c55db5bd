"""The batch engine (engine/batch.py) under the server's feet: a route trace of batched steps
replays the live counters exactly; sequences join and leave; a prompt cancelled between its
pieces stops there and leaves no prompt-cache entry; the plan holds each sequence's KV; each
sequence's KV and prompt-cache side are its own."""
from __future__ import annotations

import argparse

import pytest

from helpers import dashboard_pack
from mawforge.commands.run import make_recorder
from mawforge.engine.batch import Batch
from mawforge.engine.generate import generate
from mawforge.engine.runtime import Runtime, RuntimeOptions
from mawforge.engine.sampling import SamplingParams
from mawforge.errors import Cancelled, FormatError
from mawforge.plan import PackFacts, make_plan
from mawforge.trace.record import load_trace
from mawforge.trace.replay import live_check

PROMPTS = [[3 + (i * 37 + j * 11) % 1900 for i in range(n)] for j, n in enumerate((40, 23, 57, 9))]


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    return dashboard_pack(tmp_path_factory.mktemp("batch"))


def _greedy(rt, prompt, n):
    return [e.token for e in generate(rt, prompt, SamplingParams(max_tokens=n, ignore_eos=True))]


def test_a_trace_of_batched_steps_replays_the_live_counts(pack, tmp_path):
    path = tmp_path / "trace.npz"
    recorder = make_recorder(argparse.Namespace(trace_out=str(path), pack=pack))
    rt = Runtime(pack, RuntimeOptions(context=128, prefill_chunk=16, expert_cache_percent=30, threads=1,
                                      prompt_cache_gib=0, max_batch=3), recorder)
    try:
        got = Batch(rt, 3, piece=16).run_all([lambda s, p=p: _greedy(s, p, 6) for p in PROMPTS])
        recorder.set_live(rt.plan.E, rt.opts.policy, rt.prefetch_spec, rt.cache.core.stats())
        recorder.save(path)
    finally:
        rt.close()
    assert all(len(g) == 6 for g in got)
    trace = load_trace(path)
    steps = [(s.kind, s.n_tokens) for s in trace.steps()]
    assert ("decode", 3) in steps or ("decode", 2) in steps          # decode steps of several sequences
    assert any(kind == "prefill" and n > 16 for kind, n in steps)     # pieces of prompts beside decodes
    assert sum(n for _, n in steps) == sum(len(p) for p in PROMPTS) + 5 * len(PROMPTS)
    check = live_check(trace)
    assert check["match"], check


def test_a_cancelled_prompt_stops_between_pieces_and_leaves_no_cache_entry(pack):
    rt = Runtime(pack, RuntimeOptions(context=128, prefill_chunk=16, expert_cache_percent=100, threads=1,
                                      max_batch=2))
    try:
        batch = Batch(rt, 2, piece=16)
        pieces = []
        real = batch.begin

        def begin(seq, remaining, kind):
            pieces.append(remaining)
            return real(seq, remaining, kind)
        batch.begin = begin

        def cancelled_once_the_other_moves_on(seq):
            return list(generate(seq, PROMPTS[2], SamplingParams(max_tokens=4, ignore_eos=True),
                                 cancelled=lambda: len(pieces) >= 3))

        def beside(seq):                          # another sequence: the prompt runs in pieces of 16
            return _greedy(seq, PROMPTS[0], 30)
        with pytest.raises(Cancelled):
            batch.run_all([beside, cancelled_once_the_other_moves_on])
        # both began (pieces of 16 beside each other); the cancelled prompt stopped at a layer of
        # its second piece (41 tokens left) and never began a third (25 left)
        assert pieces[:2] == [40, 57] and 25 not in pieces
        assert all(e.tokens != tuple(PROMPTS[2]) for e in rt.prompt_cache.store.entries.values())
        # the slot is whole again: the same prompt runs to the end afterwards
        assert batch.run_all([lambda s: _greedy(s, PROMPTS[2], 3)])[0] == _greedy(rt, PROMPTS[2], 3)
    finally:
        rt.close()


def test_each_sequence_has_its_own_kv_and_prompt_cache_side(pack):
    rt = Runtime(pack, RuntimeOptions(context=128, prefill_chunk=16, expert_cache_percent=100, threads=1,
                                      max_batch=3))
    try:
        batch = Batch(rt, 3, piece=16)
        seqs = batch.seqs
        assert seqs[0].kv is rt.kv and len({id(s.kv) for s in seqs}) == 3
        assert seqs[0].prompt_cache is rt.prompt_cache
        assert seqs[1].prompt_cache.store is rt.prompt_cache.store            # one store, several live sides
        first = batch.run_all([lambda s, p=p: _greedy(s, p, 4) for p in PROMPTS[:3]])
        # the same conversation again: each slot reuses what it holds, answers unchanged
        again = batch.run_all([lambda s, p=p: _greedy(s, p, 4) for p in PROMPTS[:3]])
        assert again == first
        assert rt.prompt_cache.store.report()["hits"] >= 3
    finally:
        rt.close()


def test_the_plan_holds_the_kv_of_every_sequence(pack):
    f = PackFacts.from_pack(pack)
    one, four = make_plan(f, context=256), make_plan(f, context=256, sequences=4)
    assert four.K == 4 * one.K and four.sequences == 4 and "4 sequences" in four.table()
    with pytest.raises(FormatError):
        make_plan(f, context=256, sequences=0)
    rt = Runtime(pack, RuntimeOptions(context=128, expert_cache_percent=100, threads=1))
    try:
        from mawforge.serve.app import build_app
        from mawforge.errors import MawError
        with pytest.raises(MawError, match="max-batch 2"):
            build_app(rt, "m", max_batch=2)                 # a runtime planned for one sequence
    finally:
        rt.close()


def test_a_small_prompt_store_never_evicts_an_entry_another_sequence_is_filling(pack):
    """Three prompts prefilled side by side into a store with room for about one: an admit may
    evict only finished entries (a half-filled one is pinned by its filler), every answer is the
    answer alone."""
    from mawforge.byte_rules import prompt_entry_bytes
    from mawforge.models.kv import layer_layout
    alone = []
    for p in PROMPTS[:3]:
        solo = Runtime(pack, RuntimeOptions(context=128, prefill_chunk=16, expert_cache_percent=100, threads=1,
                                            prompt_cache_gib=0))
        try:
            alone.append(_greedy(solo, p, 4))
        finally:
            solo.close()
    probe = Runtime(pack, RuntimeOptions(context=128, prefill_chunk=16, expert_cache_percent=100, threads=1,
                                         prompt_cache_gib=0))
    one = prompt_entry_bytes(layer_layout(probe.cfg), 60, "float16", 0, probe.cfg.vocab)
    probe.close()
    rt = Runtime(pack, RuntimeOptions(context=128, prefill_chunk=16, expert_cache_percent=100, threads=1,
                                      max_batch=3, prompt_cache_gib=1.5 * one / 2**30))
    try:
        got = Batch(rt, 3, piece=16).run_all([lambda s, p=p: _greedy(s, p, 4) for p in PROMPTS[:3]])
        assert got == alone
        report = rt.prompt_cache.store.report()
        assert report["entries"] <= 2 and report["pinned"] == 0
    finally:
        rt.close()
