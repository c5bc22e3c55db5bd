"""MTP (nextn) drafting on Qwen3.5-MoE and DeepSeek-V3 fixtures that carry an MTP layer: the layer
read from HF and GGUF, one step against transformers' modules, greedy output identical to plain
decoding at several expert-cache budgets, the MTP KV kept in step with accepted tokens, exact
rollback of recurrent (delta-net) state, and sampling that keeps the target's distribution."""
from __future__ import annotations

import math

import pytest
import torch

from helpers import sample_outputs
from mawforge.engine.generate import generate
from mawforge.models.kv import KVCache
from mawforge.engine.runtime import Runtime, RuntimeOptions
from mawforge.engine.sampling import Sampler, SamplingParams
from mawforge.engine.speculative import SpecOptions, Speculator
from mawforge.errors import BudgetRejected, UnsupportedError
from mawforge.fixtures import families_ds_oss as ds
from mawforge.fixtures import families_qwen35_gemma4 as q35
from mawforge.fixtures.tiny import load_hf as load_ds_hf
from mawforge.pack.manifest import read_index, read_manifest
from mawforge.pack.packer import pack
from mawforge.plan import PackFacts, make_plan
from bounds import F32_MODEL_ATOL, F32_SAME_OPS_ATOL

PROMPT = list(range(3, 23))
SOURCES = {   # pack name -> (family, source); "hf" directories carry the MTP layer, GGUFs are made from them
    "q35-hf": ("qwen3_5_moe", "hf"), "q35-F32": ("qwen3_5_moe", "F32"), "q35-Q8_0": ("qwen3_5_moe", "Q8_0"),
    "ds3-hf": ("deepseek_v3", "hf"), "ds3-F32": ("deepseek_v3", "F32"), "ds3-Q8_0": ("deepseek_v3", "Q8_0"),
}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Lazily built {name: (source path, pack dir)}, plus {family: (hf dir, modules)} under "mods"."""
    root = tmp_path_factory.mktemp("mtp")

    class Made(dict):
        def __missing__(self, key):
            if key in ("qwen3_5_moe", "deepseek_v3"):          # the HF directory and its MTP modules
                fx = q35 if key == "qwen3_5_moe" else ds
                hf = fx.build_hf(key, root / key)
                model = q35.load_hf(hf) if key == "qwen3_5_moe" else load_ds_hf(hf)
                mods = (q35.add_mtp_block if key == "qwen3_5_moe" else ds.add_mtp_layer)(hf, model)
                self[key] = (hf, model, mods)
                return self[key]
            family, source = SOURCES[key]
            hf = self[family][0]
            fx = q35 if family == "qwen3_5_moe" else ds
            src = hf if source == "hf" else fx.write_gguf(hf, root / f"{key}.gguf", source)
            pack(src, root / f"pack-{key}", progress=False)
            self[key] = (src, root / f"pack-{key}")
            return self[key]

    return Made()


def runtime(pack_dir, budget: str = "100", context: int = 96, **kw) -> Runtime:
    # prefetch off unless asked: the exact-counterfactual checks need cache decisions that follow
    # from routing alone (auto prefetch's lookahead and on/off windows are live-only)
    kw.setdefault("prefetch", "none")
    if budget == "min":
        gib = PackFacts.from_pack(pack_dir).min_cache_bytes / 2**30
        return Runtime(pack_dir, RuntimeOptions(context=context, expert_cache_gib=gib, **kw))
    return Runtime(pack_dir, RuntimeOptions(context=context, expert_cache_percent=float(budget), **kw))


def run(pack_dir, mode: str, budget: str, params: SamplingParams, prompt=PROMPT, **spec):
    rt = runtime(pack_dir, budget)
    sp = Speculator(rt, SpecOptions(mode=mode, **spec)) if mode != "off" else None
    try:
        events = list(generate(rt, prompt, params, speculative=sp))
        kept = rt.kv.pos - len(prompt)
    finally:
        if sp is not None:
            sp.close()
        rt.close()
    return [e.token for e in events], "".join(e.text for e in events), events[-1].telemetry, kept


# ---- reading the layer ---------------------------------------------------------------------

@pytest.mark.parametrize("name", ["q35-hf", "q35-Q8_0", "ds3-hf", "ds3-Q8_0"])
def test_mtp_layer_is_packed_as_common_tensors(made, name):
    _, pack_dir = made[name]
    man = read_manifest(pack_dir)
    L = man.config.n_layers
    assert L == (4 if name.startswith("q35") else 3) and man.config.extra["mtp_layers"] == 1
    common = {r.name for r in man.common}
    assert {f"blk.{L}.nextn.eh_proj.weight", f"blk.{L}.nextn.enorm.weight", f"blk.{L}.nextn.hnorm.weight",
            f"blk.{L}.nextn.shared_head_norm.weight", f"blk.{L}.attn_norm.weight"} <= common
    assert {f"blk.{L}.ffn_down_exps.weight", f"blk.{L}.ffn_down.0.weight"} & common  # its experts stay common
    assert not any("embed_tokens" in n or "shared_head_head" in n for n in common)  # DeepSeek's duplicates dropped
    assert len(read_index(pack_dir).layers) == L                                  # no MTP blocks in the cache
    rt = runtime(pack_dir)
    try:
        assert rt.model.has_mtp and len(rt.kv.k) == L
    finally:
        rt.close()


def test_deepseek_without_mtp_tensors_has_no_mtp(tmp_path):
    """DeepSeek-V3 configs default to num_nextn_predict_layers 1; without the tensors there is no MTP."""
    hf = ds.build_hf("deepseek_v3", tmp_path / "hf")
    pack(hf, tmp_path / "pack", progress=False)
    rt = runtime(tmp_path / "pack")
    try:
        assert rt.cfg.extra["mtp_layers"] == 1 and not rt.model.has_mtp
        with pytest.raises(UnsupportedError, match="has no MTP layers"):
            Speculator(rt, SpecOptions(mode="mtp"))
        assert Speculator(rt, SpecOptions(mode="auto")).kind == "ngram"
    finally:
        rt.close()


def _reference_step(family, model, mods, ids, nxt) -> torch.Tensor:
    """One MTP step with transformers' modules: the target's final hidden states, the MTP's own
    norms and projection, its decoder layer at the hidden states' positions, its head norm."""
    with torch.no_grad():
        hidden = model.model(torch.tensor([ids])).last_hidden_state                  # [1, T, C], final-normed
        emb = model.model.embed_tokens(torch.tensor([nxt]))
        proj = mods["fc"] if family == "qwen3_5_moe" else mods["eh_proj"]
        x = proj(torch.cat((mods["enorm"](emb), mods["hnorm"](hidden)), dim=-1))
        pos = torch.arange(len(ids))[None]
        mask = torch.full((len(ids), len(ids)), float("-inf")).triu(1)[None, None]
        x = mods["layer"](x, position_embeddings=model.model.rotary_emb(x, pos), attention_mask=mask)
        x = x[0] if isinstance(x, tuple) else x
        return model.lm_head(mods["norm"](x))[0]


@pytest.mark.parametrize("name", ["q35-F32", "ds3-hf", "ds3-F32"])
def test_mtp_step_matches_the_reference(made, name):
    family = SOURCES[name][0]
    _, model, mods = made[family]
    ids, nxt = PROMPT[:12], PROMPT[1:13]
    want = _reference_step(family, model, mods, ids, nxt)
    rt = runtime(made[name][1], context=64)
    try:
        m = rt.model
        with torch.inference_mode():
            h = m.hidden(torch.tensor(ids), 0, rt.kv)
            _, got = m.mtp_step(h, torch.tensor(nxt), 0, m.mtp_cache(64))
        torch.testing.assert_close(got, want, rtol=0, atol=F32_MODEL_ATOL)
    finally:
        rt.close()


# ---- greedy: identical output, accounting ----------------------------------------------------

@pytest.mark.parametrize("budget", ["min", "50", "100"])
@pytest.mark.parametrize("name", ["q35-hf", "ds3-hf", "ds3-Q8_0"])
def test_greedy_mtp_matches_plain_decoding(made, name, budget):
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    pack_dir = made[name][1]
    want, text, t_plain, _ = run(pack_dir, "off", budget, params)
    for k in (1, 3):
        toks, got_text, t, kept = run(pack_dir, "mtp", budget, params, k=k)
        s = t.speculative
        assert toks == want and got_text == text, k
        assert kept == len(toks) - 1                            # rejected positions were rolled back
        assert s["mode"] == "mtp" and s["drafter"] == "mtp" and s["k"] == k
        assert s["drafted"] > 0 and 0 <= s["accepted"] <= s["drafted"] and s["verify_steps"] > 0
        assert 1 < s["verify_width"] <= 1 + k
        assert s["union_experts_per_layer"] >= s["single_token_experts_per_layer"] == 2.0
        assert s["draft"]["kv_cache_bytes"] > 0 and s["draft"]["mtp_proposals"] == s["verify_steps"]
        assert t.materialized_bytes - s["extra_materialized_bytes"] == t_plain.materialized_bytes
        assert t.misses - s["extra_misses"] == t_plain.misses
        if name.startswith("q35"):
            assert s["rollback_state_bytes"] > 0               # the delta-net state copy a verify step keeps


def _forced(model, truth: list[int], n_prompt: int, vocab: int):
    """Wrap mtp_propose (the MTP state still advances) so that each step's drafts are the plain
    continuation for 0, 1, 2, ... tokens and then a wrong one: every acceptance length occurs."""
    real, steps = model.mtp_propose, [0]

    def propose(context, k, sampler=None):
        drafts, _ = real(context, k, sampler)
        want = truth[len(context) - n_prompt:][:len(drafts)]
        j = steps[0] % (len(want) + 1)
        steps[0] += 1
        return want[:j] + [(t + 1) % vocab for t in want[j:j + 1]], None

    return propose


@pytest.mark.parametrize("name", ["q35-hf", "ds3-hf"])
def test_mtp_kv_follows_the_accepted_tokens(made, name, monkeypatch):
    """Drafts are accepted 0..k at a time; afterwards the MTP KV holds, for every position the
    target committed, exactly what a fresh MTP pass over the final context computes."""
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    pack_dir = made[name][1]
    want, _, _, _ = run(pack_dir, "off", "50", params)
    rt = runtime(pack_dir, "50", prefill_chunk=8)              # the prompt's hidden states come in 3 chunks
    sp = Speculator(rt, SpecOptions(mode="mtp", k=3))
    m = rt.model
    monkeypatch.setattr(m, "mtp_propose", _forced(m, want, len(PROMPT), rt.cfg.vocab))
    try:
        ev = list(generate(rt, PROMPT, params, speculative=sp))
        s = ev[-1].telemetry.speculative
        assert [e.token for e in ev] == want and 0 < s["accepted"] < s["drafted"]
        context, state = PROMPT + want, m.mtp
        n, L = state.valid, rt.cfg.n_layers
        assert n >= len(context) - 5 and state.inputs[:n] == context[1:n + 1]
        with torch.inference_mode():
            h = m.hidden(torch.tensor(context[:n]), 0, KVCache.for_config(rt.cfg, 96, torch.float32, rt.device))
            fresh = m.mtp_cache(96)
            m.mtp_step(h, torch.tensor(context[1:n + 1]), 0, fresh)
        for live, ref in ((state.kv.k[L], fresh.k[L]), (state.kv.v[L], fresh.v[L])):
            if ref is not None:
                torch.testing.assert_close(live[..., :n, :] if live.dim() == 3 else live[:n],
                                           ref[..., :n, :] if ref.dim() == 3 else ref[:n], rtol=0, atol=F32_MODEL_ATOL)
    finally:
        sp.close()
        rt.close()


def test_mtp_memory_counts_against_the_budget(made):
    """MTP drafting adds its KV cache and the kept hidden states (context x hidden float32) to L."""
    pack_dir = made["ds3-hf"][1]
    L = make_plan(PackFacts.from_pack(pack_dir), context=96, expert_cache_percent=50).L
    extra = 96 * (64 + 16) * 4 + 96 * 128 * 4                 # latent rows (kv_lora_rank + rope) + hidden rows
    for margin, fits in ((4096, True), (-4096, False)):
        rt = Runtime(pack_dir, RuntimeOptions(context=96, expert_cache_percent=50,
                                              memory_budget_gib=(L + extra + margin) / 2**30))
        try:
            if fits:
                sp = Speculator(rt, SpecOptions(mode="mtp"))
                assert sp.drafter.memory()["planned_bytes"] == extra
                sp.close()
            else:
                with pytest.raises(BudgetRejected, match="MTP"):
                    Speculator(rt, SpecOptions(mode="mtp"))
            assert rt.model.mtp is None                        # closed or refused: no hidden states kept
        finally:
            rt.close()


# ---- recurrent state rolls back exactly ----------------------------------------------------------

def test_recurrent_rollback_restores_the_state_of_the_accepted_prefix(made):
    """Verify W tokens under a mark, roll back to m of them: every delta-net state equals the one
    plain one-token decoding of the same m tokens leaves, and the next logits agree."""
    pack_dir = made["q35-hf"][1]
    spec, plain = runtime(pack_dir, prefill_chunk=4), runtime(pack_dir)
    drafts = [101, 7, 300, 44, 9]
    try:
        for m in (1, 3, 5, 6):
            spec.reset()
            spec.forward(PROMPT)
            pos = spec.kv.pos
            with pytest.raises(UnsupportedError, match="roll back"):
                spec.kv.truncate(pos - 1)                      # no mark: the state holds no positions
            spec.kv.mark()
            spec.forward([drafts[0]] + drafts[1:], all_logits=True)   # 5 positions, in chunks of 4
            spec.kv.truncate(pos + m)
            spec.kv.unmark()
            plain.reset()
            plain.forward(PROMPT)
            for t in drafts[:m]:
                plain.forward([t])
            assert spec.kv.pos == plain.kv.pos == pos + min(m, 5)
            for a, b in zip(spec.kv.state, plain.kv.state):
                for x, y in zip(a or (), b or ()):
                    torch.testing.assert_close(x, y, rtol=0, atol=F32_SAME_OPS_ATOL)
            torch.testing.assert_close(spec.forward([42]), plain.forward([42]), rtol=0, atol=F32_MODEL_ATOL)
        assert spec.kv.rollback_bytes == sum(t.nbytes for s in spec.kv.state if s for t in s)
    finally:
        spec.close()
        plain.close()


def test_rollback_replays_bit_identically(made):
    """The replay runs the chunk's recorded inputs through the same operations: rolling back to the
    end of a chunk reproduces the state the forward left there bit for bit, and rolling back to
    the mark restores the copy."""
    rt = runtime(made["q35-hf"][1])
    states = lambda: [t.clone() for s in rt.kv.state if s for t in s]
    try:
        rt.forward(PROMPT)
        P, before = rt.kv.pos, states()
        rt.kv.mark()
        rt.forward([5, 6, 7, 8])
        after_chunk = states()
        rt.forward([9])
        rt.kv.truncate(P + 4)
        assert all(torch.equal(x, y) for x, y in zip(states(), after_chunk))
        rt.kv.mark()
        rt.forward([9, 10])
        rt.kv.truncate(P + 4)
        assert all(torch.equal(x, y) for x, y in zip(states(), after_chunk))
        with pytest.raises(UnsupportedError, match="roll back"):
            rt.kv.truncate(P)                                   # the mark moved on to P + 4
        rt.kv.mark()
        rt.kv.truncate(0)                                       # a new request always works
        rt.forward(PROMPT)
        assert all(torch.equal(x, y) for x, y in zip(states(), before))
    finally:
        rt.close()


# ---- sampling keeps the target's distribution -------------------------------------------------

def test_mtp_drafted_sampling_matches_the_exact_distribution(made, monkeypatch):
    """As test_speculative's draft-model test, with the MTP drafter: t1 from prefill, t2 and t3
    from one verify step. The MTP step's last row is replaced by a deliberately skewed mix of the
    target's true next-token distribution (a random MTP layer would never be accepted), so both
    the accept and the resample paths run; 700 seeded requests must match the exact joint."""
    params = dict(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True)
    pack_dir = made["q35-hf"][1]
    rt, ref = runtime(pack_dir, context=32), runtime(pack_dir, context=32)
    prompt = [11, 12]
    sampler = Sampler(SamplingParams(**params))
    cache: dict = {}

    def dist(prefix):
        if tuple(prefix) not in cache:
            ref.reset()
            cache[tuple(prefix)] = sampler.probs(ref.forward(list(prefix))[-1])
        return cache[tuple(prefix)]

    want = {}
    p1 = dist(prompt)
    for a in torch.nonzero(p1).flatten().tolist():
        p2 = dist(prompt + [a])
        for b in torch.nonzero(p2).flatten().tolist():
            p3 = dist(prompt + [a, b])
            for c in torch.nonzero(p3).flatten().tolist():
                want[(a, b, c)] = float(p1[a] * p2[b] * p3[c])
    sp = Speculator(rt, SpecOptions(mode="mtp", k=2))
    m, real = rt.model, rt.model.mtp_step

    def skewed(hidden, tokens, pos0, kv):
        h, logits = real(hidden, tokens, pos0, kv)
        seq = prompt[:1] + m.mtp.inputs[:pos0] + tokens.tolist()     # the last row predicts position pos0 + T + 1
        p = dist(seq)
        worst = torch.where(p > 0, p, torch.full_like(p, 2.0)).argmin()
        q = 0.2 * p
        q[worst] += 0.8
        logits[-1] = torch.log(q)
        return h, logits

    monkeypatch.setattr(m, "mtp_step", skewed)
    N = 700
    try:
        counts, drafted, accepted = sample_outputs(rt, prompt, params, sp, N)
    finally:
        sp.close()
        rt.close()
        ref.close()
    assert drafted == N and 0 < accepted < N
    assert set(counts) <= set(want)
    chi2 = sum((counts.get(k, 0) - N * p) ** 2 / (N * p) for k, p in want.items())
    dof = len(want) - 1
    z = 4.75      # chi-square upper tail at p ~ 1e-6 (Wilson-Hilferty); an unverified skewed draft scores far above
    assert chi2 < dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3, chi2
