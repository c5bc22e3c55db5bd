"""Layer-major prefill waves (engine/runtime.py forward, models/base.py hidden) inside a memory
limit: the same tokens as running the prompt chunk by chunk, and each routed block read about
once a wave instead of once a chunk. Bytes, not time: the counts are deterministic. The logits
are compared bit for bit on every architecture in tests/conformance/test_shared.py."""
from __future__ import annotations

import pytest

from helpers import dashboard_pack
from mawforge.engine.generate import generate
from mawforge.engine.runtime import Runtime, RuntimeOptions
from mawforge.engine.sampling import SamplingParams
from mawforge.plan import Budget, PackFacts, make_plan, native_scratch_bytes, wave_bytes

CHUNK = 16
PROMPT = [3 + (i * 37) % 1900 for i in range(96)]        # 96 tokens: 6 chunks of 16


@pytest.fixture(scope="module")
def pack_dir(tmp_path_factory):
    """8 layers x 32 experts, top-4, skewed routing (helpers.dashboard_pack)."""
    return dashboard_pack(tmp_path_factory.mktemp("wave"))


def _run(pack_dir, **kw):
    kw.setdefault("expert_cache_percent", 40)
    rt = Runtime(pack_dir, RuntimeOptions(context=256, prefill_chunk=CHUNK, threads=1, **kw))
    try:
        evs = list(generate(rt, PROMPT, SamplingParams(max_tokens=4, ignore_eos=True)))
        return [e.token for e in evs], evs[-1].telemetry
    finally:
        rt.close()


@pytest.mark.parametrize("percent", [15, 40])
@pytest.mark.parametrize("prefetch", ["auto", "none"])
def test_a_wave_reads_each_needed_block_about_once_inside_a_limit(pack_dir, prefetch, percent):
    """Caches of 15% and 40% of the experts (1.2 and 3.2 layers' blocks) hold a layer's working
    set, not the model's: chunk by chunk (a wave of one chunk, the order before waves) every
    chunk reads most of the experts again; one wave reads each block the prompt routes to once,
    within 10%, and the tokens are the same. With auto prefetch the router lookahead runs inside
    the wave where three layers' blocks fit (40%) and stays out of the way where not (15%)."""
    chunked, before = _run(pack_dir, prefill_wave=CHUNK, prefetch=prefetch, expert_cache_percent=percent)
    waved, after = _run(pack_dir, prefetch=prefetch, expert_cache_percent=percent)
    assert waved == chunked
    needed = after.prefill_needed_bytes
    assert needed == before.prefill_needed_bytes > 0
    print(f"cache {percent}%, prefetch {prefetch}: needed {needed / 2**20:.1f} MiB; read chunk by chunk "
          f"{before.prefill_read_bytes / 2**20:.1f} MiB ({before.prefill_read_bytes / needed:.2f}x), "
          f"in one wave {after.prefill_read_bytes / 2**20:.1f} MiB ({after.prefill_read_bytes / needed:.2f}x)")
    assert needed <= after.prefill_read_bytes <= 1.1 * needed
    if prefetch == "auto" and percent == 40:
        assert after.prefetched_bytes > 0
    assert before.prefill_read_bytes >= 2 * needed


def test_waves_of_several_chunks_split_a_long_prompt(pack_dir):
    """A prompt longer than the wave runs in waves of whole chunks (the wave rounded down to
    them), each one cache step of its tokens; the tokens are those of one wave."""
    one, _ = _run(pack_dir)
    rt = Runtime(pack_dir, RuntimeOptions(context=256, prefill_chunk=CHUNK, prefill_wave=40,
                                          expert_cache_percent=40, threads=1))
    steps = []
    begin = rt.cache.begin_step
    rt.cache.begin_step = lambda kind, n: (steps.append((kind, n)), begin(kind, n))[1]
    try:
        got = [e.token for e in generate(rt, PROMPT, SamplingParams(max_tokens=4, ignore_eos=True))]
    finally:
        rt.close()
    assert got == one
    assert steps[:3] == [("prefill", 32), ("prefill", 32), ("prefill", 32)] and steps[3:] == [("decode", 1)] * 3


def test_the_wave_is_planned_in_o(pack_dir):
    """O counts the wave's activations and the native scratch of its MoE block, for the longest
    wave the context allows; a wave of one chunk plans as chunk-by-chunk prefill did."""
    f = PackFacts.from_pack(pack_dir)
    chunked = make_plan(f, context=4096, prefill_chunk=128, prefill_wave=128)
    waved = make_plan(f, context=4096, prefill_chunk=128, prefill_wave=2048)
    grown = wave_bytes(f, 2048) - wave_bytes(f, 128) + native_scratch_bytes(f, 2048) - native_scratch_bytes(f, 128)
    assert waved.O - chunked.O == grown > 0
    assert waved.C == chunked.C and waved.K == chunked.K
    # the context caps the wave; a wave is whole chunks
    assert make_plan(f, context=512, prefill_wave=2048).O == make_plan(f, context=512, prefill_wave=512).O
    assert make_plan(f, context=4096, prefill_wave=300).O == make_plan(f, context=4096, prefill_wave=256).O
    # a budget sizes the cache around it
    budget = Budget(waved.C + waved.K + waved.O + 2 * f.min_cache_bytes, "test")
    tight, loose = (make_plan(f, budget=budget, context=4096, prefill_wave=w) for w in (2048, 128))
    assert loose.E < f.expert_bytes
    assert tight.E == loose.E - grown and tight.F == loose.F


def test_a_wave_asks_one_layer_ahead_as_well_as_two(pack_dir):
    """Router lookahead inside a wave (auto prefetch, 40%: three layers' blocks fit): before layer
    l's experts it asks for layer l+2's picks and again for l+1's from the nearer input (the blocks a
    few tokens each reach, which the lookahead from two layers back missed); a decode step asks for
    l+2's only. Either way the tokens are those of a run without prefetch."""
    plain, _ = _run(pack_dir, prefetch="none")
    rt = Runtime(pack_dir, RuntimeOptions(context=256, prefill_chunk=CHUNK, expert_cache_percent=40,
                                          prefetch="auto", threads=1))
    asked, kind = [], []                     # (step kind, layers a lookahead asked for)
    ask, begin = rt.cache.lookahead, rt.cache.begin_step
    rt.cache.begin_step = lambda k, n: (kind.append(k), begin(k, n))[1]
    rt.cache.lookahead = lambda keys: (asked.append((kind[-1], sorted({layer for layer, _ in keys}))), ask(keys))[1]
    try:
        got = [e.token for e in generate(rt, PROMPT, SamplingParams(max_tokens=4, ignore_eos=True))]
    finally:
        rt.close()
    assert got == plain
    n = rt.model.cfg.n_layers
    wave = [layers for k, layers in asked if k == "prefill"]
    decode = [layers for k, layers in asked if k == "decode"]
    assert wave[0] == [1, 2] and wave[1:] == [[l + 1, l + 2] if l + 2 < n else [l + 1] for l in range(1, n - 1)]
    assert decode and all(len(layers) == 1 or layers == [1, 2] for layers in decode)
    assert [layers for layers in decode if len(layers) == 1][:n - 3] == [[l + 2] for l in range(1, n - 2)]
