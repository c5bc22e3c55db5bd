"""GLM-4.5/4.6 MoE (sigmoid grouped routing with correction bias, dense first layer, shared expert,
partial RoPE, q/k/v biases, optional q/k norm, an MTP layer) from HF directories and GGUF files:
logits against transformers, llama.cpp on the same GGUF, cache transparency, KV accounting, and
MTP drafting against transformers' modules and plain decoding."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from bounds import F32_MODEL_ATOL, LLAMA_F32_ATOL
from mawforge.engine.generate import generate
from mawforge.engine.runtime import Runtime, RuntimeOptions
from mawforge.engine.sampling import SamplingParams
from mawforge.engine.speculative import SpecOptions, Speculator
from mawforge.fixtures import family_glm4moe as fx
from mawforge.fixtures.llama_ref import llama_logits
from mawforge.fixtures.tiny import fuse_experts, load_hf
from mawforge.formats.source import open_source
from mawforge.models.kv import KVCache
from mawforge.pack.manifest import read_index, read_manifest
from mawforge.pack.packer import pack
from mawforge.plan import GiB, PackFacts, make_plan

TOKENS = list(range(5, 29))


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Lazily built {source: (source path, pack dir, hf dir)}: hf (with its MTP layer), hf_fused,
    hf_noqk (GLM-4.5-Air: no q/k norm), F32 / Q8_0 GGUFs of hf; "mods" -> (model, MTP modules)."""
    root = tmp_path_factory.mktemp("glm4moe")

    class Made(dict):
        def __missing__(self, key):
            if key == "mods":
                hf = root / "hf"
                fx.build_hf(hf)
                model = load_hf(hf)
                self[key] = (model, fx.add_mtp_layer(hf, model))
                return self[key]
            if key == "hf_noqk":
                src = hf = fx.build_hf(root / "hf_noqk", qk_norm=False)
            elif key == "hf_fused":
                hf = self["hf"][2]
                src = fx.build_hf(root / "hf_fused")
                fuse_experts(src / "model.safetensors", fx.N_EXPERTS)
            else:
                self["mods"]
                hf = root / "hf"
                src = hf if key == "hf" else fx.write_gguf(hf, root / f"glm4moe-{key}.gguf", key)
            pack(src, root / f"pack-{key}", progress=False)
            self[key] = (src, root / f"pack-{key}", hf)
            return self[key]

    return Made()


def runtime(pack_dir, **kw) -> Runtime:
    return Runtime(pack_dir, RuntimeOptions(context=64, **kw))


def hf_logits(hf_dir, tokens) -> torch.Tensor:
    with torch.no_grad():
        return load_hf(hf_dir)(torch.tensor([tokens])).logits[0].float()


def greedy(rt: Runtime, prompt: list[int], n: int) -> list[int]:
    rt.reset()
    out, logits = [], rt.forward(prompt)
    for _ in range(n):
        out.append(int(logits[-1].argmax()))
        logits = rt.forward(out[-1:])
    return out


@pytest.mark.parametrize("source", ["hf", "hf_fused", "hf_noqk", "F32"])
def test_logits_match_transformers(made, source):
    _, pack_dir, hf = made[source]
    rt = runtime(pack_dir)
    try:
        torch.testing.assert_close(rt.forward(TOKENS, all_logits=True), hf_logits(hf, TOKENS),
                                   rtol=0, atol=F32_MODEL_ATOL)
    finally:
        rt.close()


@pytest.mark.parametrize("ftype,min_top1", [("F32", 1.0), ("Q8_0", 1.0)])
def test_llama_cpp_agrees_teacher_forced(made, ftype, min_top1):
    """llama.cpp 0.3.36 on the same GGUF (its glm4moe graph; the MTP layer is in the file and
    skipped by its decoder graph). Measured: F32 max |dlogit| 3.3e-4, Q8_0 0, top-1 24/24 both."""
    gguf_path, pack_dir, _ = made[ftype]
    rt = runtime(pack_dir)
    try:
        ours = rt.forward(TOKENS, all_logits=True).numpy()
    finally:
        rt.close()
    ref = llama_logits(gguf_path, TOKENS)
    assert np.mean(ours.argmax(-1) == ref.argmax(-1)) >= min_top1
    if ftype == "F32":
        assert np.abs(ours - ref).max() <= LLAMA_F32_ATOL


@pytest.mark.parametrize("source", ["hf", "Q8_0"])
def test_cache_transparent_at_minimum(made, source):
    _, pack_dir, _ = made[source]
    facts = PackFacts.from_pack(pack_dir)
    full = runtime(pack_dir)
    tiny = runtime(pack_dir, expert_cache_gib=facts.min_cache_bytes / GiB)
    try:
        assert tiny.cache.capacity == facts.min_cache_bytes < facts.expert_bytes
        want = greedy(full, TOKENS[:9], 10)
        assert greedy(tiny, TOKENS[:9], 10) == want
        assert tiny.cache.stats()["evictions"] > 0
    finally:
        full.close()
        tiny.close()


def test_planned_kv_bytes_equal_allocation(made):
    _, pack_dir, _ = made["hf"]
    facts, cfg = PackFacts.from_pack(pack_dir), read_manifest(pack_dir).config
    for ctx, dtype in ((64, "float32"), (1000, "bfloat16")):
        plan = make_plan(facts, context=ctx, kv_dtype=dtype)
        assert plan.K == KVCache.for_config(cfg, ctx, getattr(torch, dtype), torch.device("cpu")).nbytes
    assert plan.K == 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 1000 * 2


def test_hf_and_gguf_read_the_same_config(made):
    """Both readers give one config: dense layer 0, the router, rope_dim 16 of head_dim 32, the MTP layer."""
    a, b = (read_manifest(made[s][1]).config.to_dict() for s in ("hf", "F32"))
    assert b.pop("norm_eps") == pytest.approx(a.pop("norm_eps"), rel=1e-7)      # GGUF stores float32
    assert a == b
    a = read_manifest(made["hf"][1]).config
    assert a.extra["dense_layers"] == [0] and a.extra["rope_dim"] == fx.HEAD_DIM // 2 and a.extra["mtp_layers"] == 1
    assert a.extra["router"] == {"groups": 4, "groups_used": 2, "scale": 2.5}
    assert a.shared_ff == 64 and a.qkv_bias and a.norm_topk_prob


def test_dense_layer_has_no_expert_blocks(made):
    src_path, pack_dir, _ = made["hf"]
    src, index = open_source(src_path), read_index(pack_dir)
    assert index.layers[0].offsets == () and index.layers[0].block_nbytes == 0
    assert all(len(lb.offsets) == fx.N_EXPERTS for lb in index.layers[1:])
    assert len(index.layers) == fx.LAYERS                          # the MTP layer's experts stay common
    assert {"blk.0.ffn_gate.weight", "blk.1.exp_probs_b.bias", "blk.1.ffn_up_shexp.weight"} <= set(src.common)
    facts = PackFacts.from_pack(pack_dir)
    assert facts.expert_bytes == sum(s * facts.n_experts for s in facts.slot_bytes[1:])


# ---- MTP ---------------------------------------------------------------------------------

def _reference_step(model, mods, ids, nxt) -> torch.Tensor:
    """One MTP step with transformers' modules: eh_proj(cat(enorm(embed), hnorm(final hidden))),
    the MTP decoder layer at the hidden states' positions, shared_head.norm, the LM head."""
    with torch.no_grad():
        hidden = model.model(torch.tensor([ids])).last_hidden_state                  # [1, T, C]
        x = mods["eh_proj"](torch.cat((mods["enorm"](model.model.embed_tokens(torch.tensor([nxt]))),
                                       mods["hnorm"](hidden)), dim=-1))
        mask = torch.full((len(ids), len(ids)), float("-inf")).triu(1)[None, None]
        x = mods["layer"](x, position_embeddings=model.model.rotary_emb(x, torch.arange(len(ids))[None]),
                          attention_mask=mask)
        return model.lm_head(mods["norm"](x[0] if isinstance(x, tuple) else x))[0]


@pytest.mark.parametrize("source", ["hf", "F32"])
def test_mtp_step_matches_the_reference(made, source):
    model, mods = made["mods"]
    ids, nxt = TOKENS[:12], TOKENS[1:13]
    want = _reference_step(model, mods, ids, nxt)
    rt = runtime(made[source][1])
    try:
        m = rt.model
        assert m.has_mtp and len(read_index(made[source][1]).layers) == fx.LAYERS
        with torch.inference_mode():
            _, got = m.mtp_step(m.hidden(torch.tensor(ids), 0, rt.kv), torch.tensor(nxt), 0, m.mtp_cache(64))
        torch.testing.assert_close(got, want, rtol=0, atol=F32_MODEL_ATOL)
    finally:
        rt.close()


@pytest.mark.parametrize("source", ["hf", "Q8_0"])
def test_greedy_mtp_matches_plain_decoding(made, source):
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    pack_dir = made[source][1]
    outs = []
    for mode in ("off", "mtp"):
        rt = runtime(pack_dir, expert_cache_percent=50.0)
        sp = Speculator(rt, SpecOptions(mode=mode, k=2)) if mode != "off" else None
        try:
            events = list(generate(rt, TOKENS[:9], params, speculative=sp))
        finally:
            if sp is not None:
                sp.close()
            rt.close()
        outs.append(([e.token for e in events], events[-1].telemetry))
    (plain, _), (spec, t) = outs
    assert spec == plain
    s = t.speculative
    assert s["drafter"] == "mtp" and s["drafted"] > 0 and 0 <= s["accepted"] <= s["drafted"]
