"""Continuous batching on every architecture row: requests of different prompt lengths and
lengths of answer, more of them than the batch has slots (so sequences join and leave at
different steps, and a prompt runs in pieces beside decoding sequences), greedy through one
batch against each request alone in a cold runtime. Under the smallest expert cache the plan
allows too, where the step's union of blocks is what the cache reads."""
from __future__ import annotations

import pytest

from mawforge.engine.batch import Batch

from . import api
from .cases import CASES
from .runtime_helpers import open_rt

CHUNK = 8
BASE = [3 + (i * 7) % 40 for i in range(60)]          # inside every row's vocabulary (as TOKENS)
REQUESTS = ((BASE[:21], 6), (BASE[5:42], 3), (BASE[:9], 7), (BASE[11:30], 5), (BASE[2:50], 4))

ROWS = [(c, c.plan_source) for c in CASES]


def _greedy(rt, prompt, n):
    evs = list(api.generate(rt, list(prompt), api.SamplingParams(max_tokens=n, ignore_eos=True)))
    return [e.token for e in evs], evs[-1].telemetry


# and budget "100" with a q8_0 KV cache: each sequence's own cache in ggml's 8-bit rows (the batched decode
# layer writes and reads each row's cache with its own dtype code); not the DeepSeek rows, whose latent rows
# of 80 values take none (test_prompt_cache_rows checks the error)
RUNS = [(c, s, b, None) for c, s in ROWS for b in ("100", "min")] + \
    [(c, s, "100", "q8_0") for c, s in ROWS if not c.arch.startswith("deepseek")]


@pytest.mark.parametrize("case,source,budget,kv_dtype", RUNS,
                         ids=[f"{c.id}-{s}-{b}" + ("-q8_0" if k else "") for c, s, b, k in RUNS])
def test_batched_greedy_equals_alone(sources, case, source, budget, kv_dtype):
    pack_dir = sources.pack(case, source)
    alone = []
    for prompt, n in REQUESTS:
        cold = open_rt(pack_dir, budget, context=96, prefill_chunk=CHUNK, prompt_cache_gib=0, prefetch="none",
                       kv_dtype=kv_dtype)
        try:
            alone.append(_greedy(cold, prompt, n)[0])
        finally:
            cold.close()
    rt = open_rt(pack_dir, budget, context=96, prefill_chunk=CHUNK, prompt_cache_gib=0, prefetch="none",
                 max_batch=3, kv_dtype=kv_dtype)
    try:
        batch = Batch(rt, 3, piece=CHUNK)
        steps = []
        real_step = batch.step

        def step(parked):
            out = real_step(parked)
            steps.append((batch.last.sequences, tuple(batch.last.groups)))
            return out
        batch.step = step
        got = batch.run_all([lambda seq, p=p, n=n: _greedy(seq, p, n) for p, n in REQUESTS])
        assert [g[0] for g in got] == alone, (case.arch, source, budget)
        assert any(s > 1 for s, _ in steps)                    # sequences did share steps
        assert any(groups and max(groups) > 1 for _, groups in steps)   # and decode groups of several rows
        for (prompt, n), (_, tel) in zip(REQUESTS, got):
            assert tel.prompt_tokens == len(prompt) and tel.completion_tokens == n
        # the requests' shares add up to what the cache read (each shared read counted once)
        total = rt.cache.stats()["materialized_bytes"]
        assert sum(tel.materialized_bytes for _, tel in got) == total
    finally:
        rt.close()
