"""Qwen3-Next (hybrid gated delta-net, fused qkvz/ba projections): logits against transformers from
HF and GGUF packs (llama.cpp's split attn_qkv + attn_gate and its legacy fused ssm_in), agreement
with llama.cpp on the same GGUF, cache transparency, planned bytes, config normalization, the MTP block from HF and GGUF."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mawforge.engine.generate import generate
from mawforge.engine.runtime import Runtime, RuntimeOptions
from mawforge.engine.sampling import SamplingParams
from mawforge.errors import UnsupportedError
from mawforge.fixtures.family_qwen3next import add_mtp_block, build_hf, load_hf, write_gguf
from mawforge.fixtures.llama_ref import llama_logits
from mawforge.formats.config import from_hf_config
from mawforge.pack.manifest import read_index, read_manifest
from mawforge.pack.packer import pack
from mawforge.plan import PackFacts, make_plan
from bounds import F32_MODEL_ATOL, LLAMA_F32_ATOL

TOKENS = list(range(3, 43))   # 40 positions, prefilled in chunks of 16 (recurrent state crosses chunks)
SOURCES = ("hf", "F32", "F32-legacy", "Q8_0")


@pytest.fixture(scope="module")
def fam(tmp_path_factory) -> dict:
    """{"hf": dir, source: gguf path, "packs": {source: pack dir}, "ref": HF logits [T, V]}."""
    root = tmp_path_factory.mktemp("qwen3next")
    hf = build_hf(root / "hf")
    d = {"hf": hf, "packs": {}}
    for src in SOURCES[1:]:
        d[src] = write_gguf(hf, root / f"qwen3next-{src}.gguf", src.split("-")[0], legacy=src.endswith("legacy"))
    for src in SOURCES:
        pack(d[src], root / f"pack-{src}", progress=False)
        d["packs"][src] = root / f"pack-{src}"
    with torch.no_grad():
        d["ref"] = load_hf(hf)(torch.tensor([TOKENS])).logits[0].float()
    return d


def _open(pack_dir, **kw) -> Runtime:
    opts = dict(context=96, prefill_chunk=16)
    if "expert_cache_gib" not in kw:
        opts["expert_cache_percent"] = 100
    return Runtime(pack_dir, RuntimeOptions(**(opts | kw)))


def _logits(pack_dir, **kw) -> torch.Tensor:
    rt = _open(pack_dir, **kw)
    try:
        return rt.forward(TOKENS, all_logits=True)
    finally:
        rt.close()


@pytest.mark.parametrize("source", ["hf", "F32", "F32-legacy"])
def test_f32_logits_match_transformers(fam, source):
    # measured max |diff|: 2.4e-6 (hf), 2.2e-6 (both GGUF layouts); bound 1e-4
    got = _logits(fam["packs"][source], expert_cache_percent=40)
    torch.testing.assert_close(got, fam["ref"], rtol=0, atol=F32_MODEL_ATOL)


def test_llama_cpp_agrees_on_the_same_gguf(fam):
    """llama-cpp-python 0.3.36 runs qwen3next; teacher-forced top-1 of MawForge and llama.cpp on
    the same file agree at every position (F32 split and legacy layouts, Q8_0)."""
    for src in ("F32", "F32-legacy", "Q8_0"):
        ref = llama_logits(fam[src], TOKENS)                                          # [T, V]
        got = _logits(fam["packs"][src]).numpy()
        agree = float((ref.argmax(-1) == got.argmax(-1)).mean())
        print(f"qwen3next {src}: llama.cpp top-1 agreement {agree:.3f}, max |diff| {np.abs(ref - got).max():.2e}")
        # measured: 40/40 for all three; max |diff| 5.2e-4 (F32), 3.8e-3 (Q8_0)
        assert agree == 1.0 if src != "Q8_0" else agree >= 0.95, (src, agree)
        if src != "Q8_0":
            assert np.abs(ref - got).max() < LLAMA_F32_ATOL


def test_cache_is_transparent(fam):
    pack_dir = fam["packs"]["Q8_0"]
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


def test_planned_bytes_equal_allocations(fam):
    pack_dir = fam["packs"]["F32"]
    rt = _open(pack_dir, context=64, expert_cache_percent=50)
    try:
        assert rt.plan.K == rt.kv.nbytes
        assert rt.plan.C == rt.weights.resident_bytes
        assert rt.plan.E == rt.cache.stats()["capacity_bytes"]
    finally:
        rt.close()
    facts = PackFacts.from_pack(pack_dir)
    k1, k2 = (make_plan(facts, context=n).K for n in (100, 200))
    per_pos = 2 * 2 * 2 * 32 * 4                   # 2 full-attention layers, K and V, 2 kv heads of 32, f32
    assert k2 - k1 == 100 * per_pos                # only attention layers grow with the context
    conv, state = (2 * 2 * 32 + 4 * 32) * 3, 4 * 32 * 32
    assert k1 - 100 * per_pos == 2 * 4 * (conv + state)   # two delta-net layers hold fixed state


def test_configs_from_hf_and_gguf_agree(fam):
    q = from_hf_config(json.loads((fam["hf"] / "config.json").read_text()))
    assert q.arch == "qwen3next" and q.extra["layer_types"] == ["linear", "full", "linear", "full"]
    assert q.extra["rope_dim"] == 8 and q.extra["linear"]["v_order"] == "grouped" and q.extra["norm_offset"] == 1.0
    for src in SOURCES[1:]:
        g = read_manifest(fam["packs"][src]).config
        assert g.extra["kv_layers"] == q.extra["kv_layers"] and g.extra["linear"] == q.extra["linear"]
        assert g.extra["norm_offset"] == 0.0      # the converter stores 1 + w
    names = {r.name for r in read_manifest(fam["packs"]["hf"]).common}
    assert {"blk.0.ssm_in.weight", "blk.0.ssm_ba.weight"} <= names     # HF's fused projections, kept fused


def test_dense_layers_are_refused(fam):
    c = json.loads((fam["hf"] / "config.json").read_text())
    with pytest.raises(UnsupportedError, match="dense MLP layers"):
        from_hf_config(c | {"mlp_only_layers": [0]})


def test_mtp_block_drafts_like_the_reference(tmp_path):
    """The hub checkpoints carry one MTP block that config.json does not count; packed from HF
    (mtp.*) and from GGUF (layer n_layers, nextn_predict_layers = 1) it drafts as transformers'
    own decoder layer and norms do (the MTP step is Qwen35Moe's; llama.cpp's qwen3next MTP graph is
    the same). llama.cpp still loads the file and its main logits agree."""
    hf = build_hf(tmp_path / "hf")
    model = load_hf(hf)
    mods = add_mtp_block(hf, model)
    gguf_path = write_gguf(hf, tmp_path / "mtp.gguf")
    ids, nxt = TOKENS[:12], TOKENS[1:13]
    with torch.no_grad():
        hidden = model.model(torch.tensor([ids])).last_hidden_state                  # [1, T, C], final-normed
        x = mods["fc"](torch.cat((mods["enorm"](model.model.embed_tokens(torch.tensor([nxt]))),
                                  mods["hnorm"](hidden)), dim=-1))
        pos = torch.arange(len(ids))[None]
        mask = torch.full((len(ids), len(ids)), float("-inf")).triu(1)[None, None]
        x = mods["layer"](x, position_embeddings=model.model.rotary_emb(x, pos), attention_mask=mask)
        want = model.lm_head(mods["norm"](x))[0]
        main = model(torch.tensor([TOKENS])).logits[0]
    assert (llama_logits(gguf_path, TOKENS).argmax(-1) == main.numpy().argmax(-1)).all()
    for src in (hf, gguf_path):
        pack(src, tmp_path / f"pack-{src.name}", progress=False)
        assert len(read_index(tmp_path / f"pack-{src.name}").layers) == 4     # MTP experts stay out of the cache
        rt = _open(tmp_path / f"pack-{src.name}")
        try:
            m = rt.model
            assert m.has_mtp
            with torch.inference_mode():
                h = m.hidden(torch.tensor(ids), 0, rt.kv)
                got = m.mtp_logits(h, torch.tensor(nxt), 0, m.mtp_cache(64))
            # measured max |diff| 1.9e-6 from both sources
            torch.testing.assert_close(got, want, rtol=0, atol=F32_MODEL_ATOL)
        finally:
            rt.close()
