"""Shared MTP (nextn) checks for the rows that have an MTP layer (ArchCase.mtp): the layer packed
as common tensors from HF and GGUF, one step against transformers' modules, greedy MTP decoding
identical to plain decoding at several expert-cache budgets, the MTP KV kept in step with the
accepted tokens."""
from __future__ import annotations

import json

import pytest
import torch

from bounds import F32_MODEL_ATOL
from . import api
from .cases import ids, pairs
from .runtime_helpers import open_rt

PROMPT = list(range(3, 23))
pytestmark = pytest.mark.usefixtures("one_thread")


def run(pack_dir, mode: str, budget: str, params, prompt=PROMPT, **spec):
    rt = open_rt(pack_dir, budget)
    sp = api.Speculator(rt, api.SpecOptions(mode=mode, **spec)) if mode != "off" else None
    try:
        events = list(api.generate(rt, prompt, params, speculative=sp))
        kept = rt.kv.pos - len(prompt)
    finally:
        if sp is not None:
            sp.close()
        rt.close()
    return [e.token for e in events], "".join(e.text for e in events), events[-1].telemetry, kept


MTP_PACKED = [(c, s) for c, s in pairs("mtp") if s != "mtp:F32"]


@pytest.mark.parametrize("case,source", MTP_PACKED, ids=ids(MTP_PACKED))
def test_mtp_layer_is_packed_as_common_tensors(sources, case, source):
    pack_dir = sources.pack(case, source)
    man = api.read_manifest(pack_dir)
    L = man.config.n_layers
    hf_cfg = json.loads((sources.mtp(case)[0] / "config.json").read_text())
    assert L == hf_cfg["num_hidden_layers"] and man.config.extra["mtp_layers"] == 1
    common = {r.name for r in man.common}
    assert {f"blk.{L}.nextn.eh_proj.weight", f"blk.{L}.nextn.enorm.weight", f"blk.{L}.nextn.hnorm.weight",
            f"blk.{L}.nextn.shared_head_norm.weight", f"blk.{L}.attn_norm.weight"} <= common
    assert {f"blk.{L}.ffn_down_exps.weight", f"blk.{L}.ffn_down.0.weight"} & common  # its experts stay common
    assert not any("embed_tokens" in n or "shared_head_head" in n for n in common)  # DeepSeek's duplicates dropped
    assert len(api.read_index(pack_dir).layers) == L                              # no MTP blocks in the cache
    rt = open_rt(pack_dir)
    try:
        assert rt.model.has_mtp and len(rt.kv.k) == L
    finally:
        rt.close()


def _reference_step(model, mods, ids_, nxt) -> torch.Tensor:
    """One MTP step with transformers' modules: the target's final hidden states, the MTP's own
    norms and projection, its decoder layer at the hidden states' positions, its head norm."""
    with torch.no_grad():
        hidden = model.model(torch.tensor([ids_])).last_hidden_state                 # [1, T, C], final-normed
        emb = model.model.embed_tokens(torch.tensor([nxt]))
        proj = mods["fc"] if "fc" in mods else mods["eh_proj"]
        x = proj(torch.cat((mods["enorm"](emb), mods["hnorm"](hidden)), dim=-1))
        pos = torch.arange(len(ids_))[None]
        mask = torch.full((len(ids_), len(ids_)), float("-inf")).triu(1)[None, None]
        x = mods["layer"](x, position_embeddings=model.model.rotary_emb(x, pos), attention_mask=mask)
        x = x[0] if isinstance(x, tuple) else x
        return model.lm_head(mods["norm"](x))[0]


MTP_STEP = [(c, s) for c, s in pairs("mtp") if s != "mtp:Q8_0"]


@pytest.mark.parametrize("case,source", MTP_STEP, ids=ids(MTP_STEP))
def test_mtp_step_matches_the_reference(sources, case, source):
    _, model, mods = sources.mtp(case)
    ids_, nxt = PROMPT[:12], PROMPT[1:13]
    want = _reference_step(model, mods, ids_, nxt)
    rt = open_rt(sources.pack(case, source), context=64)
    try:
        m = rt.model
        with torch.inference_mode():
            h = m.hidden(torch.tensor(ids_), 0, rt.kv)
            _, got = m.mtp_step(h, torch.tensor(nxt), 0, m.mtp_cache(64))
        torch.testing.assert_close(got, want, rtol=0, atol=F32_MODEL_ATOL)
    finally:
        rt.close()


GREEDY = [(c, s, b) for c, s in pairs("mtp_greedy") for b in ("min", "50", "100")]


@pytest.mark.parametrize("case,source,budget", GREEDY, ids=ids(GREEDY))
def test_greedy_mtp_matches_plain_decoding(sources, case, source, budget):
    params = api.SamplingParams(max_tokens=20, ignore_eos=True)
    pack_dir = sources.pack(case, source)
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
        if case.recurrent:
            assert s["rollback_state_bytes"] > 0               # the recurrent state copy a verify step keeps


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


KV = [(c, s) for c, s in pairs("mtp") if s == "mtp:hf"]


@pytest.mark.parametrize("case,source", KV, ids=ids(KV))
def test_mtp_kv_follows_the_accepted_tokens(sources, case, source, monkeypatch):
    """Drafts are accepted 0..k at a time; afterwards the MTP KV holds, for every position the
    target committed, exactly what a fresh MTP pass over the final context computes."""
    params = api.SamplingParams(max_tokens=24, ignore_eos=True)
    pack_dir = sources.pack(case, source)
    want, _, _, _ = run(pack_dir, "off", "50", params)
    rt = open_rt(pack_dir, "50", prefill_chunk=8)              # the prompt's hidden states come in 3 chunks
    sp = api.Speculator(rt, api.SpecOptions(mode="mtp", k=3))
    m = rt.model
    monkeypatch.setattr(m, "mtp_propose", _forced(m, want, len(PROMPT), rt.cfg.vocab))
    try:
        ev = list(api.generate(rt, PROMPT, params, speculative=sp))
        s = ev[-1].telemetry.speculative
        assert [e.token for e in ev] == want and 0 < s["accepted"] < s["drafted"]
        context, state = PROMPT + want, m.mtp
        n, L = state.valid, rt.cfg.n_layers
        assert n >= len(context) - 5 and state.inputs[:n] == context[1:n + 1]
        with torch.inference_mode():
            h = m.hidden(torch.tensor(context[:n]), 0, api.KVCache.for_config(rt.cfg, 96, torch.float32, rt.device))
            fresh = m.mtp_cache(96)
            m.mtp_step(h, torch.tensor(context[1:n + 1]), 0, fresh)
        for live, ref in ((state.kv.k[L], fresh.k[L]), (state.kv.v[L], fresh.v[L])):
            if ref is not None:
                torch.testing.assert_close(live[..., :n, :] if live.dim() == 3 else live[:n],
                                           ref[..., :n, :] if ref.dim() == 3 else ref[:n], rtol=0, atol=F32_MODEL_ATOL)
    finally:
        sp.close()
        rt.close()
