"""What only Qwen3.5-MoE (gated delta-net state, its MTP block) and Gemma 4 (sliding and global
layers of different shapes) have; their shared checks run from cases.CASES."""
from __future__ import annotations

import json
import math

import pytest
import torch

from bounds import F32_MODEL_ATOL, F32_SAME_OPS_ATOL
from helpers import sample_outputs
from . import api
from .cases import BY_ARCH, TOKENS
from .runtime_helpers import open_rt

Q35, G4 = BY_ARCH["qwen3_5_moe"], BY_ARCH["gemma4"]
PROMPT = list(range(3, 23))


@pytest.mark.parametrize("case", [Q35, G4], ids=lambda c: c.id)
def test_kv_grows_only_in_attention_layers(sources, case):
    pack_dir = sources.pack(case, "F32")
    facts = api.PackFacts.from_pack(pack_dir)
    k1, k2 = (api.make_plan(facts, context=n).K for n in (100, 200))
    layers = api.read_manifest(pack_dir).config.extra["kv_layers"]
    attn = [s for s in layers if s["kind"] == "kv"]
    per_pos = sum(2 * s["kv_heads"] * s["head_dim"] * 4 for s in attn)
    assert k2 - k1 == 100 * per_pos            # only attention layers grow with the context
    if case is Q35:                            # delta-net layers hold fixed state instead
        fixed = k1 - 100 * per_pos
        assert len(attn) == 2 and fixed == 2 * 4 * ((2 * 2 * 32 + 4 * 32) * 3 + 4 * 32 * 32)
    else:                                      # global layers: 1 kv head of 64; sliding: 2 of 32
        assert per_pos == 2 * 4 * (2 * 2 * 32 + 2 * 1 * 64)


def test_recurrent_state_cannot_roll_back_to_the_middle_without_a_mark(sources):
    """Delta-net state holds no positions: only KVCache.mark() (speculative verify) makes a middle
    position reachable again; without one, truncate refuses."""
    rt = open_rt(sources.pack(Q35, "F32"), prefill_chunk=16)
    try:
        rt.forward(list(TOKENS[:8]))
        with pytest.raises(api.UnsupportedError, match="roll back"):
            rt.kv.truncate(4)
        rt.reset()
        assert rt.kv.pos == 0 and all(float(t.abs().sum()) == 0 for s in rt.kv.state if s for t in s)
    finally:
        rt.close()


def test_configs_normalize_layer_types_and_state(sources):
    q = api.from_hf_config(json.loads((sources.path(Q35, "hf") / "config.json").read_text()))
    assert q.extra["layer_types"] == ["linear", "full", "linear", "full"] and q.extra["rope_dim"] == 8
    g = api.from_hf_config(json.loads((sources.path(G4, "hf") / "config.json").read_text()))
    assert g.extra["layer_types"] == ["sliding", "sliding", "full", "full"] and g.top_k == 2
    assert g.extra["full"] == {"kv_heads": 1, "head_dim": 64, "rope_base": 1e6, "rope_pairs": 8, "k_eq_v": True}
    qq, gg = (api.read_manifest(sources.pack(c, "F32")).config for c in (Q35, G4))
    assert qq.extra["kv_layers"] == q.extra["kv_layers"] and gg.extra["kv_layers"] == g.extra["kv_layers"]
    assert qq.extra["linear"]["v_order"] == "tiled" and q.extra["linear"]["v_order"] == "grouped"


def test_mtp_block_is_common_and_its_logits_are_the_steps_logits(sources, one_thread):
    """The MTP block's fused experts and attention are common tensors; mtp_logits (the draft
    logits, compared with transformers through mtp_step in test_mtp_shared) is mtp_step's."""
    pack_dir = sources.pack(Q35, "mtp:hf")
    L = api.read_manifest(pack_dir).config.n_layers
    names = {r.name for r in api.read_manifest(pack_dir).common}
    assert {f"blk.{L}.nextn.eh_proj.weight", f"blk.{L}.ffn_gate_up_exps.weight", f"blk.{L}.attn_q.weight"} <= names
    rt = open_rt(pack_dir, context=64)
    try:
        m = rt.model
        ids, nxt = torch.tensor(PROMPT[:12]), torch.tensor(PROMPT[1:13])
        with torch.inference_mode():
            h = m.hidden(ids, 0, rt.kv)
            a = m.mtp_logits(h, nxt, 0, m.mtp_cache(64))
            b = m.mtp_step(h, nxt, 0, m.mtp_cache(64))[1]
        assert torch.equal(a, b)
    finally:
        rt.close()


def test_recurrent_rollback_restores_the_state_of_the_accepted_prefix(sources, one_thread):
    """Verify W tokens under a mark, roll back to m of them: every delta-net state equals the one
    plain one-token decoding of the same m tokens leaves, and the next logits agree."""
    pack_dir = sources.pack(Q35, "mtp:hf")
    spec, plain = open_rt(pack_dir, prefill_chunk=4), open_rt(pack_dir)
    drafts = [101, 7, 300, 44, 9]
    try:
        for m in (1, 3, 5, 6):
            spec.reset()
            spec.forward(PROMPT)
            pos = spec.kv.pos
            with pytest.raises(api.UnsupportedError, match="roll back"):
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


def test_rollback_replays_bit_identically(sources, one_thread):
    """The replay runs the chunk's recorded inputs through the same operations: rolling back to the
    end of a chunk reproduces the state the forward left there bit for bit, and rolling back to
    the mark restores the copy."""
    rt = open_rt(sources.pack(Q35, "mtp:hf"))
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
        with pytest.raises(api.UnsupportedError, match="roll back"):
            rt.kv.truncate(P)                                   # the mark moved on to P + 4
        rt.kv.mark()
        rt.kv.truncate(0)                                       # a new request always works
        rt.forward(PROMPT)
        assert all(torch.equal(x, y) for x, y in zip(states(), before))
    finally:
        rt.close()


def test_mtp_drafted_sampling_matches_the_exact_distribution(sources, monkeypatch, one_thread):
    """As test_speculative's draft-model test, with the MTP drafter: t1 from prefill, t2 and t3
    from one verify step. The MTP step's last row is replaced by a deliberately skewed mix of the
    target's true next-token distribution (a random MTP layer would never be accepted), so both
    the accept and the resample paths run; 700 seeded requests must match the exact joint."""
    params = dict(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True)
    pack_dir = sources.pack(Q35, "mtp:hf")
    rt, ref = open_rt(pack_dir, context=32), open_rt(pack_dir, context=32)
    prompt = [11, 12]
    sampler = api.Sampler(api.SamplingParams(**params))
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
    sp = api.Speculator(rt, api.SpecOptions(mode="mtp", k=2))
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
