"""The prompt cache on every architecture row: a conversation's turns, a repeat, a prompt that
leaves the previous one inside a chunk, greedy through one runtime with the cache against a
fresh cold runtime per prompt. The prompts run past GPT-OSS's and Gemma 4's sliding windows and
Llama 4's short attention chunks (hf_short_chunk); hybrid rows (gated delta-net) resume only at
the checkpoints of earlier prompts; MLA (DeepSeek) rows cache their latent rows."""
from __future__ import annotations

import pytest

from mawforge.errors import UnsupportedError

from . import api
from .cases import CASES, ids
from .runtime_helpers import open_rt

CHUNK = 8
BASE = [3 + (i * 7) % 40 for i in range(60)]          # inside every row's vocabulary (as TOKENS)
PROMPTS = (BASE[:21], BASE[:37], BASE[:37], BASE[:29] + [5, 6], BASE[:45], BASE[:21])

ROWS = [(c, c.plan_source) for c in CASES] + [(c, "hf_short_chunk") for c in CASES if "hf_short_chunk" in c.hf]


def _greedy(rt, prompt, n=4):
    evs = list(api.generate(rt, list(prompt), api.SamplingParams(max_tokens=n, ignore_eos=True)))
    return [e.token for e in evs], evs[-1].telemetry


@pytest.mark.parametrize("kv_dtype", [None, "q8_0"])
@pytest.mark.parametrize("case,source", ROWS, ids=ids(ROWS))
def test_cached_continuations_equal_cold_prefills(sources, case, source, kv_dtype):
    """kv_dtype q8_0: the same with ggml's 8-bit cache rows (the torch path quantizes a prompt's
    rows, the native decode step its own: the same bytes, so a reused row is the row a cold prefill
    writes). The DeepSeek rows cache latent rows of 80 values (kv_lora_rank 64 + rope 16), which
    q8_0's blocks of 32 cannot hold: a clear error before anything loads."""
    pack_dir = sources.pack(case, source)
    if kv_dtype == "q8_0" and case.arch.startswith("deepseek"):
        with pytest.raises(UnsupportedError, match="rows of a multiple of 32 values; this model caches rows of 80"):
            open_rt(pack_dir, "100", context=96, kv_dtype=kv_dtype)
        return
    rt = open_rt(pack_dir, "100", context=96, prefill_chunk=CHUNK, prompt_cache_gib=1 / 64, kv_dtype=kv_dtype)
    cold = open_rt(pack_dir, "100", context=96, prefill_chunk=CHUNK, prompt_cache_gib=0, kv_dtype=kv_dtype)
    try:
        cached = []
        for p in PROMPTS:
            got, tel = _greedy(rt, p)
            assert got == _greedy(cold, p)[0], (case.arch, source, len(p))
            cached.append((tel.cached_tokens, tel.prompt_cache["source"]))
        if case.recurrent:      # checkpoints: 16 and 21 (the first prompt), 32 and 37, 24 and 31, ...
            assert cached == [(0, "none"), (16, "saved"), (37, "saved"), (16, "saved"), (32, "saved"),
                              (21, "saved")]
            entry = next(e for e in rt.prompt_cache.store.entries.values() if e.tokens == tuple(PROMPTS[0]))
            assert entry.checkpoints == (16, 21) and sorted(entry.payload.states) == [16, 21]
        else:
            assert cached == [(0, "none"), (16, "live"), (37, "saved"), (24, "live"), (32, "saved"),
                              (16, "live")]
    finally:
        rt.close()
        cold.close()
