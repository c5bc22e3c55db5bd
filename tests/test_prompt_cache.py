"""The prompt cache (engine/prompt_cache.py, engine/prompt_reuse.py): the reuse rule, the store's
LRU by bytes and its pins, the keys, an interrupted prefill, planned == allocated, and cached
continuations equal to cold ones. Every architecture row: tests/conformance/test_prompt_cache_rows.py."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from mawforge.engine import prompt_reuse
from mawforge.engine.generate import generate
from mawforge.engine.prompt_cache import Entry, PromptStore, canonical, reusable
from mawforge.engine.runtime import Runtime, RuntimeOptions
from mawforge.engine.sampling import SamplingParams
from mawforge.plan import Budget, PackFacts, make_plan

CHUNK = 16
BASE = [5 + (i * 37) % 900 for i in range(200)]       # distinct-ish ids inside the tiny vocab


def greedy(rt, prompt, n=5):
    evs = list(generate(rt, list(prompt), SamplingParams(max_tokens=n, ignore_eos=True)))
    return [e.token for e in evs], evs[-1].telemetry


def open_rt(pack_dir, prompt_store=None, **kw) -> Runtime:
    kw = {"context": 256, "prefill_chunk": CHUNK, "threads": 1, "expert_cache_percent": 100, **kw}
    return Runtime(pack_dir, RuntimeOptions(**kw), prompt_store=prompt_store)


@pytest.fixture(scope="module")
def pack_dir(packs):
    return packs[("qwen3_moe", "Q8_0")]


# ---- the rule and the store, by hand -----------------------------------------------------------

def test_reuse_rule_takes_whole_chunks_checkpoints_and_exact_repeats():
    seq = list(range(100, 150))                        # 50 tokens, chunk 16: rows exact up to 48
    c = canonical(len(seq), CHUNK)
    assert c == 48
    assert reusable(seq, c, seq + [1, 2], CHUNK) == 48             # extends it: whole chunks only
    assert reusable(seq, c, seq[:40] + [9], CHUNK) == 32           # diverges at 40
    assert reusable(seq, c, seq[:48], CHUNK) == 32                 # one token must be left to run
    assert reusable(seq, c, seq, CHUNK) == 48                      # the same prompt, no saved logits
    assert reusable(seq, c, seq, CHUNK, exact=True) == 50          # ... with them: nothing to run
    assert reusable(seq, c, [7] + seq, CHUNK) == 0
    # a recurrent model: only where a state was saved (its canonical length and its end)
    assert reusable(seq, c, seq + [1], CHUNK, checkpoints=(48, 50)) == 48
    assert reusable(seq, c, seq[:40] + [9], CHUNK, checkpoints=(48, 50)) == 0
    assert reusable(seq, c, seq, CHUNK, checkpoints=(48, 50), exact=True) == 50


def _entry(key, tokens, nbytes, checkpoints=None):
    e = Entry(key, tuple(tokens), canonical(len(tokens), CHUNK), checkpoints, nbytes)
    return e


def _admit(store, e):
    assert store.admit(e)
    store.commit(e)
    return e


def test_store_evicts_least_recently_used_by_bytes_and_never_a_pinned_entry():
    store = PromptStore(300)
    a, b, c = (_admit(store, _entry("k", [t] * 40, 100)) for t in (1, 2, 3))
    assert store.held == 300
    got, n = store.lookup("k", [1] * 40 + [5], CHUNK)              # a is used: b is now the oldest
    assert got is a and n == 32 and a.pins == 1
    d = _admit(store, _entry("k", [4] * 40, 100))
    assert [e.tokens[0] for e in store.entries.values()] == [3, 1, 4] and b.payload is None
    store.release(a)
    # pinned entries stay: with all three pinned, a new one is refused and nothing is evicted
    for e in (a, c, d):
        store.lookup("k", list(e.tokens) + [9], CHUNK)
    assert not store.admit(_entry("k", [6] * 40, 100)) and store.held == 300 and len(store.entries) == 3
    for e in (a, c, d):
        store.release(e)
    assert not store.admit(_entry("k", [7] * 40, 301))             # larger than the whole budget
    big = _admit(store, _entry("k", [8] * 40, 250))                 # evicts the three oldest...
    assert list(store.entries.values()) == [big] and store.held == 250
    assert store.report()["evictions"] == 4 and store.report()["refused"] == 2


def test_store_keys_apart_unready_entries_and_superseded_prefixes():
    store = PromptStore(10_000)
    e = _admit(store, _entry("a", BASE[:40], 100))
    assert store.lookup("b", BASE[:60], CHUNK) == (None, 0)        # another configuration's prefix
    got, n = store.lookup("a", BASE[:100], CHUNK)                  # a request uses e: pinned
    assert got is e and n == 32
    half = _entry("a", BASE[:80], 100)
    assert store.admit(half)                                      # held, its prefill not done yet
    assert store.lookup("a", BASE[:100], CHUNK) == (e, 32)        # ... so no lookup takes it
    store.release(e)
    store.release(e)
    store.commit(half)
    assert len(store.entries) == 2                                # e was pinned: not superseded
    longer = _admit(store, _entry("a", BASE[:120], 100))           # e and half are prefixes of it
    assert list(store.entries.values()) == [longer]
    hybrid = [_admit(store, _entry("h", BASE[:n], 100, (n // CHUNK * CHUNK, n))) for n in (20, 40)]
    assert all(id(h) in store.entries for h in hybrid)            # checkpoints at other places: kept


# ---- on a real runtime ------------------------------------------------------------------------

@pytest.mark.parametrize("source", ["Q8_0", "F32"])
def test_chat_turns_reuse_and_match_the_cold_prefill(packs, source):
    """Q8_0 (native kernels throughout: rows exact) reuses down to the token, the answer's decoded
    rows included; F32 (torch matmuls, whose bits follow the row count) whole chunks only."""
    on, off = open_rt(packs[("qwen3_moe", source)]), open_rt(packs[("qwen3_moe", source)], prompt_cache_gib=0)
    try:
        assert on.prompt_cache is not None and off.prompt_cache is None
        exact = source == "Q8_0"
        assert on.prompt_cache.granule == (1 if exact else CHUNK)
        turn1 = BASE[:40]
        out1, t1 = greedy(on, turn1)
        turn2 = turn1 + out1 + BASE[100:130]
        turn3 = turn2 + [11, 12] + BASE[130:160]
        seen = []
        for p in (turn1, turn2, turn3, turn3, turn2[:50] + [3, 4, 5]):
            got, tel = greedy(on, p)
            assert got == greedy(off, p)[0]
            seen.append((tel.cached_tokens, tel.prompt_cache["source"]))
        if exact:       # turn 2 keeps turn 1 and 4 of its 5 answer tokens (the last one has no row yet)
            assert seen == [(40, "saved"), (44, "live"), (len(turn2), "live"), (len(turn3), "saved"), (50, "live")]
        else:
            assert seen == [(40, "saved"), (32, "live"), (64, "live"), (len(turn3), "saved"), (48, "live")]
        assert t1.cached_tokens == 0 and t1.prompt_cache["source"] == "none"
        assert greedy(off, turn1)[1].prompt_cache == {"source": "off"}
    finally:
        on.close()
        off.close()


@pytest.mark.parametrize("source", ["Q8_0", "Q4_K_M"])
def test_rows_are_exact_in_any_chunk(packs, source):
    """What token-granular reuse rests on (prompt_reuse.rows_exact): a prompt run in pieces of any
    size, one token included (the decode step's path), leaves bit-identical KV rows and logits."""
    rt = open_rt(packs[("qwen3_moe", source)], prompt_cache_gib=0)
    try:
        assert prompt_reuse.rows_exact(rt)
        prompt = BASE[:70]

        def run(cuts):
            rt.reset()
            for a, b in zip([0, *cuts], [*cuts, len(prompt)]):
                logits = rt.forward(prompt[a:b])
            return logits, [r.clone() for r in rt.kv.export_rows(len(prompt))]
        cold, rows = run([])
        for cuts in ([16, 32, 48, 64], [5], [1, 2, 3, 37], [69], [20, 21, 50, 51, 52]):
            got, got_rows = run(cuts)
            assert torch.equal(got, cold), cuts
            assert all(torch.equal(a, b) for a, b in zip(got_rows, rows)), cuts
    finally:
        rt.close()


def test_planned_bytes_are_the_bytes_held(pack_dir):
    rt = open_rt(pack_dir, prompt_cache_gib=64 * 1024 / 2**30)
    try:
        plan = make_plan(PackFacts.from_pack(pack_dir), context=256, expert_cache_percent=100, prefill_chunk=CHUNK,
                         prompt_cache_gib=64 * 1024 / 2**30)
        assert rt.plan.P == plan.P == rt.prompt_cache.store.budget == 64 * 1024
        assert rt.plan.L == plan.C + plan.E + plan.K + plan.P
        for i in range(8):                             # more prompts than fit: the oldest go
            greedy(rt, BASE[i * 20:i * 20 + 30], 2)
            store = rt.prompt_cache.store
            assert store.held <= store.budget
            for e in store.entries.values():           # the byte rule is the bytes allocated
                p = e.payload
                held = sum(t.nbytes for t in p.rows) + p.logits.nbytes + sum(
                    t.nbytes for s in p.states.values() for layer in s for t in layer)
                assert held == e.nbytes and p.rows[0].shape[-2] == len(e.tokens)
        assert store.report()["evictions"] > 0
    finally:
        rt.close()


def test_auto_size_follows_the_context_and_the_budget(pack_dir):
    f = PackFacts.from_pack(pack_dir)
    free = make_plan(f, context=256, prompt_cache_gib=None)
    assert free.P == 2 * (free.K + 4 * f.vocab) and free.L == free.C + free.E + free.K + free.P
    tight = make_plan(f, context=256, prompt_cache_gib=None,
                      budget=Budget(free.C + free.K + free.O + 5 * free.P, "test"))
    room = tight.budget_bytes - tight.C - tight.K - tight.O      # what E and P share under a budget
    assert tight.P == int(room * 0.1) < free.P and tight.E == min(room - tight.P, f.expert_bytes)
    given = make_plan(f, context=256, prompt_cache_gib=None, expert_cache_percent=100,
                      budget=Budget(free.C + free.E + free.K + free.O + free.P // 3, "test"))
    assert given.P == given.budget_bytes - given.L + given.P - given.O      # a given cache: only the slack
    over = make_plan(f, context=256, prompt_cache_gib=1.0, expert_cache_percent=100,
                     budget=Budget.from_gib((free.C + free.E + free.K) / 2**30 + 0.5, "test"))
    assert not over.feasible and "C + E + K + P" in over.reason
    assert make_plan(f, context=256).P == 0                       # make_plan's own default: off


def test_plan_prints_p_and_rejects_what_does_not_fit(pack_dir):
    plan = lambda *a: subprocess.run([sys.executable, "-m", "mawforge.cli", "plan", "--pack", str(pack_dir),
                                      "--context", "256", *a], capture_output=True, text=True)
    auto, off = (json.loads(plan("--json", *a).stdout) for a in ((), ("--prompt-cache-gib", "0")))
    f = PackFacts.from_pack(pack_dir)
    assert auto["P"] == make_plan(f, context=256, prompt_cache_gib=None).P > 0 and off["P"] == 0
    assert auto["L"] == auto["C"] + auto["E"] + auto["K"] + auto["P"] and auto["F"] == auto["L"] + auto["O"]
    table = plan("--prompt-cache-gib", "0.5")
    assert table.returncode == 0 and f"({2**29:,} B)  [--prompt-cache-gib]" in table.stdout
    assert "L  = C + E + K + P" in table.stdout
    budget = str((auto["C"] + auto["E"] + auto["K"]) / 2**30 + 0.25)
    refused = plan("--prompt-cache-gib", "0.5", "--expert-cache-percent", "100", "--memory-budget-gib", budget)
    assert refused.returncode == 4 and "REJECTED: L = C + E + K + P" in refused.stdout


def test_a_key_keeps_other_packs_and_configurations_out(packs, pack_dir):
    store = PromptStore(1 << 24)
    rts = {name: open_rt(d, prompt_store=store, **kw) for name, d, kw in (
        ("a", pack_dir, {}), ("same", pack_dir, {}), ("f32kv", pack_dir, {"kv_dtype": "float32"}),
        ("chunk", pack_dir, {"prefill_chunk": 8}), ("other", packs[("qwen3_moe", "F32")], {}),
        ("other-chunk", packs[("qwen3_moe", "F32")], {"prefill_chunk": 8}))}
    try:
        prompt = BASE[:40]
        greedy(rts["a"], prompt)
        greedy(rts["other"], prompt)
        for name in ("f32kv", "other-chunk"):
            assert greedy(rts[name], prompt)[1].cached_tokens == 0, name
        assert greedy(rts["same"], prompt)[1].cached_tokens == 40      # the same configuration shares it
        # rows exact in any chunk (Q8_0's native kernels): another chunk size computes the same rows
        assert greedy(rts["chunk"], prompt)[1].cached_tokens == 40
        assert rts["a"].prompt_cache.key == (rts["a"].manifest.pack_digest, "float16", "rows", "cpu")
        assert rts["other"].prompt_cache.key[2] == CHUNK
    finally:
        for rt in rts.values():
            rt.close()


def test_an_interrupted_prefill_leaves_no_entry_and_no_live_prefix(pack_dir):
    rt, off = open_rt(pack_dir), open_rt(pack_dir, prompt_cache_gib=0)
    try:
        prompt = BASE[:60]

        def boom(done, total):
            if done >= 2 * CHUNK:
                raise KeyboardInterrupt
        rt.on_chunk = boom
        with pytest.raises(KeyboardInterrupt):
            greedy(rt, prompt)
        rt.on_chunk = None
        r = rt.prompt_cache.report()
        assert (r["entries"], r["held_bytes"], r["pinned"], r["saved"]) == (0, 0, 0, 0)
        got, tel = greedy(rt, prompt)
        assert tel.cached_tokens == 0 and got == greedy(off, prompt)[0]
    finally:
        rt.close()
        off.close()


def test_a_dropped_or_cancelled_request_frees_its_pin_at_once(pack_dir):
    rt = open_rt(pack_dir)
    try:
        greedy(rt, BASE[:40])
        greedy(rt, BASE[100:140])                                  # the live KV holds another prompt now
        gen = generate(rt, BASE[:40] + [7, 8], SamplingParams(max_tokens=20, ignore_eos=True))
        next(gen)
        store = rt.prompt_cache.store
        assert store.report()["pinned"] == 1                        # the request is using the entry
        gen.close()                                                 # the client went away
        assert store.report()["pinned"] == 0
        evs = list(generate(rt, BASE[:40], SamplingParams(max_tokens=20, ignore_eos=True),
                            cancelled=lambda: True))
        assert evs[-1].finish_reason == "cancelled" and store.report()["pinned"] == 0
    finally:
        rt.close()


def test_windowed_layers_keep_every_row_so_every_prefix_stays_usable():
    """Sliding-window and chunked attention are masks over a full-context KV here (models/kv.py
    allocates `context` rows for every attention layer), so no row a window passed is overwritten:
    the usable length is the same for every attention layer. tests/conformance checks gpt-oss,
    Gemma 4 and Llama 4 continuations against cold prefills past their windows."""
    from mawforge.byte_rules import layer_state
    spec = {"kind": "kv", "kv_heads": 2, "head_dim": 8, "window": 4}
    assert layer_state(spec, 96) == [((2, 96, 8), True)] * 2
