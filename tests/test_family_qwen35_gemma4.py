"""Qwen3.5-MoE (hybrid gated delta-net) and Gemma 4 MoE: logits against transformers from HF and
GGUF packs, llama.cpp agreement on the same GGUF, cache transparency, planned bytes, MTP."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mawforge.engine.generate import generate
from mawforge.engine.runtime import Runtime, RuntimeOptions
from mawforge.engine.sampling import SamplingParams
from mawforge.errors import UnsupportedError
from mawforge.fixtures.families_qwen35_gemma4 import FAMILIES, add_mtp_block, build_hf, load_hf, write_gguf
from mawforge.fixtures.llama_ref import llama_logits
from mawforge.formats.config import from_hf_config
from mawforge.pack.manifest import read_index, read_manifest
from mawforge.pack.packer import pack
from mawforge.plan import PackFacts, make_plan
from bounds import F32_MODEL_ATOL

TOKENS = list(range(3, 43))   # 40 positions, prefilled in chunks of 16 (recurrent state crosses chunks)


@pytest.fixture(scope="module")
def family_root(tmp_path_factory) -> dict:
    """{family: {"hf": dir, "F32": gguf, "Q8_0": gguf, "packs": {source: pack dir}}}."""
    root = tmp_path_factory.mktemp("families")
    out = {}
    for fam in FAMILIES:
        hf = build_hf(fam, root / fam / "hf")
        d = {"hf": hf, "packs": {}}
        for ft in ("F32", "Q8_0"):
            d[ft] = write_gguf(hf, root / fam / f"{fam}-{ft}.gguf", ft)
        for src in ("hf", "F32", "Q8_0"):
            pack(d[src], root / fam / f"pack-{src}", progress=False)
            d["packs"][src] = root / fam / f"pack-{src}"
        out[fam] = d
    return out


@pytest.fixture(scope="module")
def hf_logits(family_root) -> dict:
    out = {}
    for fam in FAMILIES:
        with torch.no_grad():
            out[fam] = load_hf(family_root[fam]["hf"])(torch.tensor([TOKENS])).logits[0].float()
    return out


def _open(pack_dir, **kw) -> Runtime:
    opts = dict(context=96, prefill_chunk=16)
    if "expert_cache_gib" not in kw:
        opts["expert_cache_percent"] = 100
    return Runtime(pack_dir, RuntimeOptions(**(opts | kw)))


def _logits(pack_dir, tokens=TOKENS, **kw) -> torch.Tensor:
    rt = _open(pack_dir, **kw)
    try:
        return rt.forward(tokens, all_logits=True)
    finally:
        rt.close()


@pytest.mark.parametrize("fam", FAMILIES)
@pytest.mark.parametrize("source", ["hf", "F32"])
def test_f32_logits_match_transformers(family_root, hf_logits, fam, source):
    # measured max |diff|: qwen3_5_moe 2.4e-6 (hf) / 2.8e-6 (gguf), gemma4 6.1e-6 (both); bound 1e-4
    got = _logits(family_root[fam]["packs"][source], expert_cache_percent=40)
    torch.testing.assert_close(got, hf_logits[fam], rtol=0, atol=F32_MODEL_ATOL)


@pytest.mark.parametrize("fam", FAMILIES)
def test_llama_cpp_agrees_on_the_same_gguf(family_root, hf_logits, fam):
    """The vendored llama.cpp (llama-cpp-python 0.3.36) runs both archs; teacher-forced top-1 of
    MawForge and llama.cpp on the same file agree at every position (F32 and Q8_0)."""
    for ft in ("F32", "Q8_0"):
        ref = llama_logits(family_root[fam][ft], TOKENS)                       # [T, V]
        got = _logits(family_root[fam]["packs"][ft]).numpy()
        agree = float((ref.argmax(-1) == got.argmax(-1)).mean())
        # llama.cpp quantizes activations to 8 bits for Q8_0 matmuls; measured Q8_0 top-1:
        # qwen3_5_moe 39/40 positions, gemma4 40/40; F32: 40/40 for both
        assert agree >= (1.0 if ft == "F32" else 0.95), (ft, agree)
        print(f"{fam} {ft}: llama.cpp top-1 agreement {agree:.3f}, max |diff| {np.abs(ref - got).max():.2e}")
        # measured: F32 max |diff| 5.7e-4 (qwen3_5_moe), 7.9e-3 (gemma4, logits soft-capped at 30)
        if ft == "F32":
            assert np.abs(ref - got).max() < 2e-2


@pytest.mark.parametrize("fam", FAMILIES)
def test_cache_is_transparent(family_root, fam):
    pack_dir = family_root[fam]["packs"]["Q8_0"]
    index = read_index(pack_dir)
    cfg = read_manifest(pack_dir).config
    minimum = max(-(-lb.block_nbytes // 4096) * 4096 for lb in index.layers) * cfg.top_k

    def greedy(**kw):
        rt = _open(pack_dir, **kw)
        try:
            evs = list(generate(rt, TOKENS[:20], SamplingParams(max_tokens=12, ignore_eos=True)))
            return [e.token for e in evs], rt.cache.stats()
        finally:
            rt.close()

    want, full = greedy(expert_cache_percent=100)
    got, small = greedy(expert_cache_gib=minimum / 2**30)
    assert got == want and len(want) == 12
    assert small["evictions"] > 0 and full["evictions"] == 0
    again, _ = greedy(expert_cache_percent=100)     # a second request starts from reset state
    assert again == want


@pytest.mark.parametrize("fam", FAMILIES)
def test_planned_bytes_equal_allocations(family_root, fam):
    pack_dir = family_root[fam]["packs"]["F32"]
    rt = _open(pack_dir, context=64, expert_cache_percent=50)
    try:
        assert rt.plan.K == rt.kv.nbytes
        assert rt.plan.C == rt.weights.resident_bytes
        assert rt.plan.E == rt.cache.stats()["capacity_bytes"]
    finally:
        rt.close()
    facts = PackFacts.from_pack(pack_dir)
    k1, k2 = (make_plan(facts, context=n).K for n in (100, 200))
    layers = read_manifest(pack_dir).config.extra["kv_layers"]
    attn = [s for s in layers if s["kind"] == "kv"]
    per_pos = sum(2 * s["kv_heads"] * s["head_dim"] * 4 for s in attn)
    assert k2 - k1 == 100 * per_pos            # only attention layers grow with the context
    if fam == "qwen3_5_moe":                   # delta-net layers hold fixed state instead
        fixed = k1 - 100 * per_pos
        assert len(attn) == 2 and fixed == 2 * 4 * ((2 * 2 * 32 + 4 * 32) * 3 + 4 * 32 * 32)
    else:                                      # global layers: 1 kv head of 64; sliding: 2 of 32
        assert per_pos == 2 * 4 * (2 * 2 * 32 + 2 * 1 * 64)


def test_recurrent_state_cannot_roll_back_to_the_middle_without_a_mark(family_root):
    """Delta-net state holds no positions: only KVCache.mark() (speculative verify) makes a middle
    position reachable again (tests/test_mtp.py); without one, truncate refuses."""
    rt = _open(family_root["qwen3_5_moe"]["packs"]["F32"])
    try:
        rt.forward(TOKENS[:8])
        with pytest.raises(UnsupportedError, match="roll back"):
            rt.kv.truncate(4)
        rt.reset()
        assert rt.kv.pos == 0 and all(float(t.abs().sum()) == 0 for s in rt.kv.state if s for t in s)
    finally:
        rt.close()


def test_configs_normalize_layer_types_and_state(family_root):
    q = from_hf_config(json.loads((family_root["qwen3_5_moe"]["hf"] / "config.json").read_text()))
    assert q.extra["layer_types"] == ["linear", "full", "linear", "full"] and q.extra["rope_dim"] == 8
    g = from_hf_config(json.loads((family_root["gemma4"]["hf"] / "config.json").read_text()))
    assert g.extra["layer_types"] == ["sliding", "sliding", "full", "full"] and g.top_k == 2
    assert g.extra["full"] == {"kv_heads": 1, "head_dim": 64, "rope_base": 1e6, "rope_pairs": 8, "k_eq_v": True}
    for src in ("F32",):
        qq, gg = (read_manifest(family_root[f]["packs"][src]).config for f in FAMILIES)
        assert qq.extra["kv_layers"] == q.extra["kv_layers"] and gg.extra["kv_layers"] == g.extra["kv_layers"]
        assert qq.extra["linear"]["v_order"] == "tiled" and q.extra["linear"]["v_order"] == "grouped"


def test_mtp_block_is_packed_and_drafts_like_the_reference(tmp_path):
    hf = build_hf("qwen3_5_moe", tmp_path / "hf")
    model = load_hf(hf)
    mods = add_mtp_block(hf, model)
    pack(hf, tmp_path / "pack", progress=False)
    man = read_manifest(tmp_path / "pack")
    L = man.config.n_layers
    names = {r.name for r in man.common}
    assert {f"blk.{L}.nextn.eh_proj.weight", f"blk.{L}.ffn_gate_up_exps.weight", f"blk.{L}.attn_q.weight"} <= names
    assert len(read_index(tmp_path / "pack").layers) == L        # MTP experts stay out of the cache
    ids, nxt = TOKENS[:12], TOKENS[1:13]
    with torch.no_grad():
        hidden = model.model(torch.tensor([ids])).last_hidden_state                  # [1, T, C], final-normed
        x = mods["fc"](torch.cat((mods["enorm"](model.model.embed_tokens(torch.tensor([nxt]))),
                                  mods["hnorm"](hidden)), dim=-1))
        pos = torch.arange(len(ids))[None]
        mask = torch.full((len(ids), len(ids)), float("-inf")).triu(1)[None, None]
        x = mods["layer"](x, position_embeddings=model.model.rotary_emb(x, pos), attention_mask=mask)
        want = model.lm_head(mods["norm"](x))[0]
    rt = _open(tmp_path / "pack")
    try:
        m = rt.model
        assert m.has_mtp
        with torch.inference_mode():
            h = m.hidden(torch.tensor(ids), 0, rt.kv)
            got = m.mtp_logits(h, torch.tensor(nxt), 0, m.mtp_cache(64))
        torch.testing.assert_close(got, want, rtol=0, atol=F32_MODEL_ATOL)
    finally:
        rt.close()
