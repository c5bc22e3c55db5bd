"""The bounded runtime: cache transparency across policies, budgets, bad inputs, telemetry, threads.
Logits against transformers and llama.cpp, per architecture, live in tests/conformance/."""
from __future__ import annotations

import shutil

import pytest
import torch

from helpers import ARCHS
from mawforge.engine.generate import generate
from mawforge.engine.runtime import Runtime, RuntimeOptions
from mawforge.engine.sampling import SamplingParams
from mawforge.errors import BudgetRejected, IntegrityError, RequestError
from mawforge.pack.manifest import EXPERTS, read_index

TOKENS = list(range(3, 43))   # 40 positions


def _runtime(pack, **kw) -> Runtime:
    opts = dict(context=320, prefill_chunk=16)
    if "expert_cache_gib" not in kw:
        opts["expert_cache_percent"] = 100
    opts.update(kw)
    return Runtime(pack, RuntimeOptions(**opts))


def _greedy(pack, n=24, **kw):
    rt = _runtime(pack, **kw)
    try:
        ids = rt.tokenizer.encode("The expert cache keeps what the router asks for")
        evs = list(generate(rt, ids, SamplingParams(max_tokens=n, ignore_eos=True)))
        return [e.token for e in evs], rt.cache.stats(), evs[-1].telemetry
    finally:
        rt.close()


@pytest.mark.parametrize("source", ["Q4_K_M", "F32"])
def test_cache_is_transparent_across_policies_and_budgets(packs, source):
    pack = packs[("qwen3_moe", source)]
    want, full, _ = _greedy(pack)
    index = read_index(pack)
    minimum = max(-(-lb.block_nbytes // 4096) * 4096 for lb in index.layers) * 2
    sizes = {-(-lb.block_nbytes // 4096) * 4096 for lb in index.layers}
    assert (len(sizes) > 1) == (source == "Q4_K_M")    # Q4_K_M's layers mix block types
    for policy in ("lru", "lfu", "fifo", "random:7", "s3fifo"):
        for kw in (dict(expert_cache_gib=minimum / 2**30), dict(expert_cache_percent=40),
                   dict(expert_cache_percent=100)):
            got, stats, _ = _greedy(pack, policy=policy, **kw)
            assert got == want, (policy, kw)
            assert stats["peak_held_bytes"] <= stats["capacity_bytes"]
            assert stats["hits"] + stats["misses"] > 0
            if len(sizes) > 1 and kw.get("expert_cache_percent") == 40:
                # the layers' blocks differ in size: misses took free slots of other sizes
                assert stats["reshaped_slots"] > 0, (policy, kw)
    got, stats, _ = _greedy(pack, expert_cache_percent=40, prefetch="confidence:0.2")
    # prefetch ran (the routers of this model give top-2 weights >= 0.2), went through the same
    # byte budget, and each prefetched block was either used, evicted unused, or is still waiting
    assert got == want and stats["prefetch_issued"] > 0
    assert stats["prefetch_issued_bytes"] == (stats["prefetch_useful_bytes"] + stats["prefetch_wasted_bytes"]
                                              + stats["prefetch_pending_bytes"])
    assert stats["peak_held_bytes"] <= stats["capacity_bytes"]
    got, _, _ = _greedy(pack, expert_cache_percent=40, lookahead=True)
    assert got == want


def test_slot_memory_resizes_keeping_its_bytes_and_its_tensor_over_them():
    from mawforge.cache.store import SlotMemory, round_page
    m = SlotMemory(10000)
    assert m.size == round_page(10000) and m.host.numel() == m.size and m.host.data_ptr() % 4096 == 0
    m.host.copy_(torch.arange(m.size, dtype=torch.int64).remainder(251).to(torch.uint8))
    want = m.host.clone()
    m.resize(3 * 4096)                      # shrink: the first pages stay as they were
    assert m.size == 3 * 4096 and torch.equal(m.host, want[:3 * 4096])
    m.resize(40000)                         # grow: kept pages first, new pages zero
    assert m.size == round_page(40000) and torch.equal(m.host[:3 * 4096], want[:3 * 4096])
    assert int(m.host[3 * 4096:].sum()) == 0
    m.host[-1] = 7
    assert m.buf[-1] == 7                   # preadv's buffer and the tensor are the same bytes
    m.close()
    assert m.host is None and m.buf is None
    m.close()                               # a second close does nothing


def test_smaller_cache_misses_more(packs):
    pack = packs[("qwen2_moe", "Q4_K_M")]
    _, small, t_small = _greedy(pack, expert_cache_percent=30)
    _, big, t_big = _greedy(pack, expert_cache_percent=100)
    assert small["misses"] > big["misses"] and small["evictions"] > 0 and big["evictions"] == 0
    assert t_small.materialized_bytes > t_big.materialized_bytes
    assert t_small.expert_cache_bytes < t_big.expert_cache_bytes


def test_budget_below_minimum_is_refused_with_the_minimum(packs):
    pack = packs[("olmoe", "Q8_0")]
    with pytest.raises(BudgetRejected, match="working set"):
        _runtime(pack, expert_cache_gib=1e-4)


def test_stream_embeddings_gives_same_logits_and_less_resident(packs):
    pack = packs[("qwen3_moe", "Q8_0")]
    a = _runtime(pack)
    b = _runtime(pack, stream_embeddings=True)
    try:
        torch.testing.assert_close(b.forward(TOKENS, all_logits=True), a.forward(TOKENS, all_logits=True),
                                   rtol=0, atol=0)
        assert b.weights.resident_bytes < a.weights.resident_bytes
        assert b.weights.embedding_bytes_read > 0
    finally:
        a.close()
        b.close()


def test_bad_requests(packs):
    rt = _runtime(packs[("qwen3_moe", "Q8_0")], context=32)
    try:
        with pytest.raises(RequestError, match="empty"):
            list(generate(rt, [], SamplingParams()))
        with pytest.raises(RequestError, match="context"):
            list(generate(rt, list(range(5, 40)), SamplingParams()))
        with pytest.raises(RequestError, match="stop token"):
            list(generate(rt, [5, 6], SamplingParams(stop_token_ids=(10**6,))))
        with pytest.raises(RequestError):
            SamplingParams(temperature=-1)
        evs = list(generate(rt, [5, 6, 7], SamplingParams(max_tokens=100, ignore_eos=True)))
        # 29 generated tokens fill the context; the 30th is sampled from the last position
        assert evs[-1].finish_reason == "length" and len(evs) == 32 - 3 + 1
    finally:
        rt.close()


def test_damaged_block_is_an_error_not_garbage(packs, tmp_path):
    pack = tmp_path / "p"
    shutil.copytree(packs[("mixtral", "Q8_0")], pack)
    index = read_index(pack)
    for layer in range(len(index.layers)):
        for e in range(len(index.layers[layer].offsets)):
            off, n, _ = index.block(layer, e)
            with open(pack / EXPERTS, "r+b") as f:
                f.seek(off + 100)
                b = f.read(1)
                f.seek(off + 100)
                f.write(bytes([b[0] ^ 1]))
    rt = _runtime(pack)
    try:
        with pytest.raises(IntegrityError, match="damaged"):
            rt.forward(TOKENS)
    finally:
        rt.close()


def test_stop_strings_and_sampling_are_reproducible(packs):
    rt = _runtime(packs[("qwen2_moe", "F16")])
    try:
        ids = rt.tokenizer.encode("Once upon a time")
        p = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=50, min_p=0.01, seed=3, ignore_eos=True)
        a = [e.token for e in generate(rt, ids, p)]
        b = [e.token for e in generate(rt, ids, p)]
        assert a == b and len(a) == 16
        text = "".join(e.text for e in generate(rt, ids, SamplingParams(max_tokens=16, ignore_eos=True)))
        stop = text[3:6]
        evs = list(generate(rt, ids, SamplingParams(max_tokens=16, stop=(stop,), ignore_eos=True)))
        out = "".join(e.text for e in evs)
        assert evs[-1].finish_reason == "stop" and stop not in out and text.startswith(out)
    finally:
        rt.close()


def test_telemetry_is_consistent(packs):
    toks, stats, t = _greedy(packs[("olmoe", "Q4_K_M")], expert_cache_percent=50)
    assert t.completion_tokens == len(toks) == 24
    assert t.hits + t.misses == stats["hits"] + stats["misses"]
    assert 0 <= t.hit_rate <= 1 and t.kv_cache_bytes > 0 and t.resident_common_bytes > 0
    assert t.peak_rss_bytes > 0 and t.pack_digest and t.ttft_s > 0


def test_stall_meter_counts_tokens_and_nearest_rank_percentiles():
    from mawforge.telemetry import StallMeter
    m = StallMeter()
    assert m.summary() == (0.0, 0.0, 0.0)
    for wait, toks in ((0.0, 1), (0.004, 3), (0.0, 1), (0.001, 1), (0.002, 2)):
        m.record(wait, toks)
    assert m.summary() == (6 / 8, 0.002, 0.004)          # waits 1, 2, 4 ms; 6 of 8 tokens waited


def test_read_stalls_in_telemetry_follow_the_reads(packs):
    """At the smallest cache decode steps miss, so tokens wait on reads; with the whole model
    resident after a first request, the same request reads nothing and nothing waits."""
    pack = packs[("qwen3_moe", "Q4_K_M")]
    index = read_index(pack)
    minimum = max(-(-lb.block_nbytes // 4096) * 4096 for lb in index.layers) * 2
    _, stats, t = _greedy(pack, expert_cache_gib=minimum / 2**30)
    assert t.misses > 0 and 0 < t.decode_stall_token_share <= 1
    assert 0 < t.decode_stall_p50_s <= t.decode_stall_p95_s
    assert "read stalls" in t.line() and t.to_dict()["decode_stall_p95_s"] == t.decode_stall_p95_s
    rt = _runtime(pack, expert_cache_percent=100)
    try:
        ids = rt.tokenizer.encode("The expert cache keeps what the router asks for")
        params = SamplingParams(max_tokens=12, ignore_eos=True)
        first = list(generate(rt, ids, params))[-1].telemetry
        again = list(generate(rt, ids, params))[-1].telemetry
    finally:
        rt.close()
    assert first.misses > 0 and again.misses == 0
    assert (again.decode_stall_token_share, again.decode_stall_p50_s, again.decode_stall_p95_s) == (0.0, 0.0, 0.0)


def test_online_chooser_explores_exploits_and_probes_every_arm():
    from mawforge.engine.online import OnlineChooser
    c = OnlineChooser((4, 2, 1), window=2, probe_every=3)
    speed = {4: 10.0, 2: 30.0, 1: 20.0}                       # tokens/s of each arm
    used = []
    for _ in range(60):
        arm = c.mode()
        used.append(arm)
        c.record(arm, 1, 1 / speed[arm])
    assert used[:6] == [4, 4, 2, 2, 1, 1]                    # each arm explored, in order
    after = used[6::2]                                       # one entry per window after exploring
    assert after.count(2) == len(after) - len(after) // 3   # the fastest, but for one probe in three
    assert after.count(4) > 0 and after.count(1) > 0         # the probes go round the others
    assert c.rate[2] == pytest.approx(30.0) and c.windows[4] + c.windows[2] + c.windows[1] == 30


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("source", ["F32", "Q4_K_M"])
def test_thread_governor_changes_threads_not_tokens(packs, arch, source):
    """The governor switches torch's and the kernels' thread counts between one-token decode
    steps, whose bits do not depend on them (GEMVs and the native kernels split outputs, not
    sums), so greedy tokens equal those of a fixed count; prefill and the end of the request
    run at the full count. A governor forced to switch every few steps shows it (with probe_every=1
    it would sit on the probed arm for good whenever 2 threads were the faster, so 2)."""
    from mawforge.engine.threads import ThreadGovernor
    from mawforge.kernels import native
    pack = packs[(arch, source)]
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        want, _, fixed = _greedy(pack, expert_cache_percent=40, thread_governor=False)
        assert fixed.compute_threads == {"threads": 2, "governor": False}
        rt = _runtime(pack, expert_cache_percent=40)
        # best and a probe alternate, whichever is faster; a core taken all along (else it would not probe)
        rt.governor = ThreadGovernor(2, window=1, probe_every=2, load=lambda: 1.0)
        try:
            ids = rt.tokenizer.encode("The expert cache keeps what the router asks for")
            ev = list(generate(rt, ids, SamplingParams(max_tokens=24, ignore_eos=True)))
        finally:
            rt.close()
        t = ev[-1].telemetry
        assert [e.token for e in ev] == want
        g = t.compute_threads
        assert g["switches"] >= 2 and g["windows"]["2"] > 0 and g["windows"]["1"] > 0
        assert torch.get_num_threads() == 2 and native._limit is None      # close() gives the kernels back
    finally:
        torch.set_num_threads(n)


def test_prefill_bytes_read_against_the_bytes_its_experts_need(packs):
    """From an empty cache each block the prompt routes to is read at least once: at a whole
    cache exactly once; at the smallest cache exactly once too when the prompt runs as one
    layer-major wave (each layer's blocks in groups that fit, read once), more when it runs
    chunk by chunk (a wave of one chunk: the chunks evict each other's blocks); a repeated
    request with the whole model resident reads nothing though it needs the same."""
    pack = packs[("qwen3_moe", "Q4_K_M")]
    index = read_index(pack)
    minimum = max(-(-lb.block_nbytes // 4096) * 4096 for lb in index.layers) * 2
    prompt = list(range(3, 83))                              # 80 tokens: 5 chunks of 16
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    for kw in (dict(expert_cache_percent=100), dict(expert_cache_gib=minimum / 2**30),
               dict(expert_cache_gib=minimum / 2**30, prefill_wave=16)):
        rt = _runtime(pack, prompt_cache_gib=0, **kw)     # the repeat prefills again (no prompt cache)
        try:
            first = list(generate(rt, prompt, params))[-1].telemetry
            again = list(generate(rt, prompt, params))[-1].telemetry
        finally:
            rt.close()
        assert first.prefill_needed_bytes == again.prefill_needed_bytes > 0
        if "prefill_wave" in kw:
            assert first.prefill_read_bytes > first.prefill_needed_bytes
        else:
            assert first.prefill_read_bytes == first.prefill_needed_bytes
        if "expert_cache_percent" in kw:
            assert again.prefill_read_bytes == 0


def test_a_quiet_machine_keeps_every_thread_and_a_busy_one_measures_afresh():
    """While other processes use under QUIET_CORES the governor runs the full count without
    exploring or probing (its steps are safe to time); when one takes a core, every count is
    measured again under that load, and the choice follows the measured speeds."""
    from mawforge.engine.threads import QUIET_CORES, ThreadGovernor
    others = [0.0]
    gov = ThreadGovernor(2, window=2, probe_every=2, load=lambda: others[0])
    try:
        used = []
        for _ in range(20):
            n = gov.before_step()
            used.append(n)
            gov.after_step(n, 1, 0.1)
        # the first window measures the full count (the load is not known yet), then quiet
        assert used == [2] * 20 and gov.switches == 0 and gov.settled()
        rep = gov.report()
        assert rep["quiet_windows"] == 10 and rep["busy_windows"] == 0 and rep["others_cores"] == 0.0
        others[0] = 1.0                                   # a program takes a core
        used = []
        for _ in range(12):
            n = gov.before_step()
            used.append(n)
            gov.after_step(n, 1, 0.1 if n == 1 else 0.4)  # one thread is now the faster
        assert 1 in used and used[-2:] == [1, 1] and gov.report()["busy_windows"] >= 5
        assert gov.report()["tok_s"]["1"] == pytest.approx(10.0)
        others[0] = QUIET_CORES / 2                       # the core is given back
        for _ in range(4):
            n = gov.before_step()
            gov.after_step(n, 1, 0.1)
        assert gov.before_step() == 2 and gov.settled()
    finally:
        gov.close()


def test_cpu_load_reads_the_other_processes_share_of_proc_stat(tmp_path):
    """CpuLoad: the busy jiffies of /proc/stat's cpu line (all but idle and iowait) over the
    wall time, less this process's CPU time; an unreadable or foreign file gives None."""
    from mawforge.engine.threads import CpuLoad
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 50 1000 10 0 0 0 0 0\n")
    load = CpuLoad(str(stat))
    t0 = load._last
    stat.write_text(f"cpu  {100 + load.tick * 10} 0 50 1000 10 0 0 0 0 0\n")     # 10 s busy since
    got = load.others()
    now = load._last
    want = (10.0 - (now[2] - t0[2])) / (now[0] - t0[0])
    assert got == pytest.approx(want) and got > 1.0                     # far more than the wall time
    stat.write_text("intr 5\n")
    assert load.others() is None
    assert CpuLoad(str(tmp_path / "missing")).others() is None
