"""DeepSeek V2/V3 (MLA, grouped sigmoid routing, dense first layers) and GPT-OSS (sinks, sliding
windows, clamped SwiGLU, MXFP4 experts) from HF directories and GGUF files: logits against
transformers, tokens against llama.cpp, cache transparency and KV accounting."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from mawforge.models.kv import KVCache
from mawforge.engine.runtime import Runtime, RuntimeOptions
from mawforge.errors import UnsupportedError
from mawforge.fixtures import families_ds_oss as fx
from mawforge.fixtures.llama_ref import llama_logits
from mawforge.fixtures.tiny import load_hf
from mawforge.formats.source import open_source
from mawforge.pack.manifest import read_index, read_manifest
from mawforge.pack.packer import pack
from mawforge.plan import GiB, PackFacts, make_plan

TOKENS = list(range(5, 29))       # 24 positions: past GPT-OSS's sliding window of 4


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Lazily built {(arch, source): (source path, pack dir)}; source is hf, hf_yarn or a GGUF ftype."""
    root = tmp_path_factory.mktemp("ds_oss")

    class Made(dict):
        def __missing__(self, key):
            arch, source = key
            hf = root / f"{arch}-hf{'-yarn' if source == 'hf_yarn' else ''}"
            if not hf.exists():
                fx.build_hf(arch, hf, yarn=True if source == "hf_yarn" else None)
            src = hf if source.startswith("hf") else fx.write_gguf(hf, root / f"{arch}-{source}.gguf", source)
            out = root / f"pack-{arch}-{source}"
            pack(src, out, progress=False)
            self[key] = (src, out, hf)
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


@pytest.mark.parametrize("arch,source", [("deepseek_v3", "hf"), ("deepseek_v3", "hf_yarn"), ("deepseek_v2", "hf"),
                                         ("gpt_oss", "hf"), ("deepseek_v3", "F32")])
def test_logits_match_transformers(made, arch, source):
    _, pack_dir, hf = made[(arch, source)]
    rt = runtime(pack_dir)
    ours = rt.forward(TOKENS, all_logits=True)
    ref = hf_logits(hf, TOKENS)
    assert (ours - ref).abs().max().item() <= 1e-4
    rt.close()


def test_gptoss_gguf_matches_transformers_up_to_yarn_truncation(made):
    """GGUF carries no YaRN `truncate` flag; llama.cpp (and so MawForge on GGUF) rounds the ramp
    bounds, which the HF config of GPT-OSS does not: logits differ by ~4e-4 on F32."""
    _, pack_dir, hf = made[("gpt_oss", "F32")]
    rt = runtime(pack_dir)
    ours = rt.forward(TOKENS, all_logits=True)
    ref = hf_logits(hf, TOKENS)
    assert (ours - ref).abs().max().item() <= 2e-3
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    rt.close()


@pytest.mark.parametrize("arch,ftype,min_top1", [("deepseek_v3", "F32", 1.0), ("gpt_oss", "F32", 1.0),
                                                 ("gpt_oss", "MXFP4", 0.9), ("deepseek_v3", "Q8_0", 0.9)])
def test_llama_cpp_agrees_teacher_forced(made, arch, ftype, min_top1):
    """Teacher-forced top-1 against llama.cpp on the same GGUF. Measured: F32 1.00 (max |dlogit|
    2.5e-4 DeepSeek, 4.1e-4 GPT-OSS); MXFP4 0.95 and Q8_0 0.95 (llama.cpp quantizes activations)."""
    gguf_path, pack_dir, _ = made[(arch, ftype)]
    rt = runtime(pack_dir)
    ours = rt.forward(TOKENS, all_logits=True).numpy()
    ref = llama_logits(gguf_path, TOKENS)
    assert np.mean(ours.argmax(-1) == ref.argmax(-1)) >= min_top1
    rt.close()


@pytest.mark.parametrize("arch,source", [("deepseek_v3", "hf"), ("gpt_oss", "MXFP4")])
def test_cache_transparent_at_minimum(made, arch, source):
    _, pack_dir, _ = made[(arch, source)]
    facts = PackFacts.from_pack(pack_dir)
    full = runtime(pack_dir)
    tiny = runtime(pack_dir, expert_cache_gib=facts.min_cache_bytes / GiB)
    assert tiny.cache.capacity == facts.min_cache_bytes < facts.expert_bytes
    prompt = TOKENS[:9]
    want = greedy(full, prompt, 10)
    assert greedy(tiny, prompt, 10) == want
    assert tiny.cache.stats()["evictions"] > 0
    full.close()
    tiny.close()


@pytest.mark.parametrize("arch,source", [("deepseek_v3", "hf"), ("gpt_oss", "hf")])
def test_planned_kv_bytes_equal_allocation(made, arch, source):
    _, pack_dir, _ = made[(arch, source)]
    facts, cfg = PackFacts.from_pack(pack_dir), read_manifest(pack_dir).config
    for ctx, dtype in ((64, "float32"), (1000, "bfloat16")):
        plan = make_plan(facts, context=ctx, kv_dtype=dtype)
        assert plan.K == KVCache.for_config(cfg, ctx, getattr(torch, dtype), torch.device("cpu")).nbytes
    if arch == "deepseek_v3":       # compressed: one (kv_lora_rank + qk_rope) row per layer and position
        m = cfg.extra["mla"]
        assert plan.K == cfg.n_layers * 1000 * (m["kv_lora_rank"] + m["qk_rope"]) * 2
        assert plan.K < 2 * cfg.n_layers * cfg.n_heads * (m["qk_nope"] + m["qk_rope"]) * 1000 * 2


def test_dense_layers_have_no_expert_blocks(made):
    src_path, pack_dir, _ = made[("deepseek_v3", "hf")]
    src, index = open_source(src_path), read_index(pack_dir)
    dense = src.config.extra["dense_layers"]
    assert dense == [0]
    assert index.layers[0].offsets == () and index.layers[0].block_nbytes == 0
    assert all(len(lb.offsets) == src.config.n_experts for lb in index.layers[1:])
    assert "blk.0.ffn_gate.weight" in src.common and "blk.1.exp_probs_b.bias" in src.common
    facts = PackFacts.from_pack(pack_dir)
    assert facts.expert_bytes == sum(s * facts.n_experts for s in facts.slot_bytes[1:])


def test_gptoss_expert_blocks_carry_biases(made):
    for source, kinds in (("hf", {"gate_up_t", "down_t", "gate_up_bias", "down_bias"}),
                          ("MXFP4", {"gate", "up", "down", "gate_bias", "up_bias", "down_bias"})):
        _, pack_dir, _ = made[("gpt_oss", source)]
        lb = read_index(pack_dir).layers[0]
        assert {t.name for t in lb.tensors} == kinds
        if source == "MXFP4":
            w = {t.name: t for t in lb.tensors}
            assert w["gate"].qtype == "MXFP4" and w["gate"].codec == "ggml"
            assert w["gate"].nbytes == 64 * (fx.HIDDEN // 32) * 17      # F rows of H/32 MXFP4 blocks


def test_hf_mxfp4_checkpoint_is_refused_with_advice(made, tmp_path):
    _, _, hf = made[("gpt_oss", "hf")]
    d = tmp_path / "mxfp4"
    d.mkdir()
    (d / "config.json").write_text((hf / "config.json").read_text())
    save_file({"model.layers.0.mlp.experts.gate_up_proj_blocks": torch.zeros(8, 128, 4, 16, dtype=torch.uint8)},
              str(d / "model.safetensors"))
    with pytest.raises(UnsupportedError, match="MXFP4.*GGUF"):
        open_source(d)
