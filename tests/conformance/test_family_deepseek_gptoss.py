"""What only DeepSeek V2/V3 (MLA, grouped routing, MTP without tensors) and GPT-OSS (YaRN from
GGUF, biased MXFP4 experts) have; their shared checks run from cases.CASES."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from . import api
from .cases import BY_ARCH, TOKENS
from .runtime_helpers import logits, mtp_rt

DS3, OSS = BY_ARCH["deepseek_v3"], BY_ARCH["gpt_oss"]


def test_gptoss_gguf_matches_transformers_up_to_yarn_truncation(sources):
    """GGUF carries no YaRN `truncate` flag; llama.cpp (and so MawForge on GGUF) rounds the ramp
    bounds, which the HF config of GPT-OSS does not: logits differ by ~4e-4 on F32."""
    ours = logits(sources.pack(OSS, "F32"), TOKENS)
    ref = sources.hf_logits(OSS)
    assert (ours - ref).abs().max().item() <= 2e-3
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_mla_kv_is_compressed(sources):
    """DeepSeek's KV holds one (kv_lora_rank + qk_rope) row per layer and position."""
    pack_dir = sources.pack(DS3, "hf")
    facts, cfg = api.PackFacts.from_pack(pack_dir), api.read_manifest(pack_dir).config
    plan = api.make_plan(facts, context=1000, kv_dtype="bfloat16")
    m = cfg.extra["mla"]
    assert plan.K == cfg.n_layers * 1000 * (m["kv_lora_rank"] + m["qk_rope"]) * 2
    assert plan.K < 2 * cfg.n_layers * cfg.n_heads * (m["qk_nope"] + m["qk_rope"]) * 1000 * 2


def test_deepseek_dense_layer_and_correction_bias_are_common(sources):
    src = api.open_source(sources.path(DS3, "hf"))
    assert src.config.extra["dense_layers"] == list(DS3.dense_layers) == [0]
    assert "blk.0.ffn_gate.weight" in src.common and "blk.1.exp_probs_b.bias" in src.common


def test_gptoss_expert_blocks_carry_biases(sources):
    for source, kinds in (("hf", {"gate_up_t", "down_t", "gate_up_bias", "down_bias"}),
                          ("MXFP4", {"gate", "up", "down", "gate_bias", "up_bias", "down_bias"})):
        lb = api.read_index(sources.pack(OSS, source)).layers[0]
        assert {t.name for t in lb.tensors} == kinds
        if source == "MXFP4":
            w = {t.name: t for t in lb.tensors}
            assert w["gate"].qtype == "MXFP4" and w["gate"].codec == "ggml"
            hidden = api.fixture("gpt_oss").HIDDEN
            assert w["gate"].nbytes == 64 * (hidden // 32) * 17      # F rows of H/32 MXFP4 blocks


def test_hf_mxfp4_checkpoint_is_refused_with_advice(sources, tmp_path):
    hf = sources.path(OSS, "hf")
    d = tmp_path / "mxfp4"
    d.mkdir()
    (d / "config.json").write_text((hf / "config.json").read_text())
    save_file({"model.layers.0.mlp.experts.gate_up_proj_blocks": torch.zeros(8, 128, 4, 16, dtype=torch.uint8)},
              str(d / "model.safetensors"))
    with pytest.raises(api.UnsupportedError, match="MXFP4.*GGUF"):
        api.open_source(d)


def test_deepseek_without_mtp_tensors_has_no_mtp(sources):
    """DeepSeek-V3 configs default to num_nextn_predict_layers 1; without the tensors there is no MTP."""
    rt = mtp_rt(sources.pack(DS3, "hf"))
    try:
        assert rt.cfg.extra["mtp_layers"] == 1 and not rt.model.has_mtp
        with pytest.raises(api.UnsupportedError, match="has no MTP layers"):
            api.Speculator(rt, api.SpecOptions(mode="mtp"))
        assert api.Speculator(rt, api.SpecOptions(mode="auto")).kind == "ngram"
    finally:
        rt.close()


def test_mtp_memory_counts_against_the_budget(sources, one_thread):
    """MTP drafting adds its KV cache and the kept hidden states (context x hidden float32) to L."""
    pack_dir = sources.pack(DS3, "mtp:hf")
    L = api.make_plan(api.PackFacts.from_pack(pack_dir), context=96, expert_cache_percent=50).L
    extra = 96 * (64 + 16) * 4 + 96 * 128 * 4                 # latent rows (kv_lora_rank + rope) + hidden rows
    for margin, fits in ((4096, True), (-4096, False)):
        rt = api.Runtime(pack_dir, api.RuntimeOptions(context=96, expert_cache_percent=50,
                                                      budget=api.Budget(L + extra + margin, "test")))
        try:
            if fits:
                sp = api.Speculator(rt, api.SpecOptions(mode="mtp"))
                assert sp.drafter.memory()["planned_bytes"] == extra
                sp.close()
            else:
                with pytest.raises(api.BudgetRejected, match="MTP"):
                    api.Speculator(rt, api.SpecOptions(mode="mtp"))
            assert rt.model.mtp is None                        # closed or refused: no hidden states kept
        finally:
            rt.close()
