"""Llama 4 MoE (interleaved dense/MoE layers, shared expert, top-1 sigmoid routing on the expert
input, chunked attention with NoPE layers, L2 qk norm, temperature tuning, llama3 RoPE) from HF
directories and GGUF files: logits against transformers, agreement with llama.cpp, exact chunked
attention, cache transparency, readers."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from mawforge.engine.runtime import Runtime, RuntimeOptions
from mawforge.errors import UnsupportedError
from mawforge.fixtures import family_llama4 as fx
from mawforge.fixtures.llama_ref import llama_logits
from mawforge.fixtures.tiny import load_hf
from mawforge.formats.config import from_gguf_metadata, from_hf_config
from mawforge.formats.source import open_source
from mawforge.models.kv import KVCache
from mawforge.pack.manifest import read_index, read_manifest
from mawforge.pack.packer import pack
from mawforge.plan import GiB, PackFacts, make_plan

TOKENS = [int(t) for t in np.random.RandomState(2).randint(3, 1000, size=24)]
SHORT = dict(chunk=5, floor_scale=3)     # chunking and temperature visible within 24 positions


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Lazily built {source: (source path, pack dir, hf dir)}; source: hf, hf_short, F32, Q8_0."""
    root = tmp_path_factory.mktemp("llama4")

    class Made(dict):
        def __missing__(self, source):
            short = source == "hf_short"
            hf = root / ("hf-short" if short else "hf")
            if not hf.exists():
                fx.build_hf(hf, **(SHORT if short else {}))
            src = hf if source.startswith("hf") else fx.write_gguf(hf, root / f"l4-{source}.gguf", source)
            out = root / f"pack-{source}"
            pack(src, out, progress=False)
            self[source] = (src, out, hf)
            return self[source]

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


@pytest.mark.parametrize("source", ["hf", "hf_short", "F32"])
def test_logits_match_transformers(made, source):
    """Measured max |dlogit|: 1.7e-6 (hf), 1.5e-6 (hf_short), 1.4e-6 (GGUF F32)."""
    _, pack_dir, hf = made[source]
    rt = runtime(pack_dir)
    ours = rt.forward(TOKENS, all_logits=True)
    ref = hf_logits(hf, TOKENS)
    assert (ours - ref).abs().max().item() <= 1e-4
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    rt.close()


@pytest.mark.parametrize("ftype,max_diff", [("F32", 2e-3), ("Q8_0", 2e-3)])
def test_llama_cpp_agrees_teacher_forced(made, ftype, max_diff):
    """Same GGUF through llama.cpp. Measured: F32 max |dlogit| 4.1e-4, Q8_0 0.0; top-1 24/24 both."""
    gguf_path, pack_dir, _ = made[ftype]
    rt = runtime(pack_dir)
    ours = rt.forward(TOKENS, all_logits=True).numpy()
    ref = llama_logits(gguf_path, TOKENS)
    assert np.abs(ours - ref).max() <= max_diff
    assert np.mean(ours.argmax(-1) == ref.argmax(-1)) == 1.0
    rt.close()


def test_chunked_attention_exact_across_chunk_boundaries(made):
    """Token-by-token decode and uneven prefill pieces cross chunk boundaries (chunk 5) at other
    offsets than one batch; all equal the batch. Turning the chunk mask or the NoPE temperature
    off changes the logits, so the transformers match above depends on both."""
    _, pack_dir, _ = made["hf_short"]
    rt = runtime(pack_dir)
    batch = rt.forward(TOKENS, all_logits=True)
    for pieces in ([7] + [1] * 17, [3, 4, 9, 8], [5, 5, 5, 5, 4]):
        rt.reset()
        got, at = [], 0
        for n in pieces:
            got.append(rt.forward(TOKENS[at:at + n], all_logits=True))
            at += n
        assert (torch.cat(got) - batch).abs().max().item() <= 1e-5
    model = rt.model
    chunk, temp = model.chunk, model.temp
    for change in ({"chunk": [None] * len(chunk)}, {"temp": None}):
        for k, v in change.items():
            setattr(model, k, v)
        rt.reset()
        assert (rt.forward(TOKENS, all_logits=True) - batch).abs().max().item() > 1e-2
        model.chunk, model.temp = chunk, temp
    rt.close()


def test_routing_scales_expert_input(made):
    """sigmoid(logit) multiplies the expert's input: weighting its output instead (the other
    MoE families' rule) gives different logits, so the transformers match pins the rule."""
    _, pack_dir, _ = made["hf"]
    rt = runtime(pack_dir)
    want = rt.forward(TOKENS, all_logits=True)
    model, ffn = rt.model, rt.model.ffn

    def output_weighted(layer, x):
        if layer not in model.moe:
            return ffn(layer, x)
        idx, w = model.route(layer, x)
        return model._swiglu(x, f"blk.{layer}.", "_shexp") + model.experts(layer, x, idx, w)

    model.ffn = output_weighted
    rt.reset()
    assert (rt.forward(TOKENS, all_logits=True) - want).abs().max().item() > 1e-2
    rt.close()


@pytest.mark.parametrize("source,lookahead", [("hf", False), ("Q8_0", False), ("Q8_0", True)])
def test_cache_transparent_at_minimum(made, source, lookahead):
    """Greedy tokens at the smallest cache equal those at 100%; with next-layer lookahead the
    router of a dense layer is asked too (it answers no experts)."""
    _, pack_dir, _ = made[source]
    facts = PackFacts.from_pack(pack_dir)
    full = runtime(pack_dir)
    tiny = runtime(pack_dir, expert_cache_gib=facts.min_cache_bytes / GiB, lookahead=lookahead)
    assert tiny.cache.capacity == facts.min_cache_bytes < facts.expert_bytes
    prompt = TOKENS[:9]
    want = greedy(full, prompt, 10)
    assert greedy(tiny, prompt, 10) == want
    assert tiny.cache.stats()["evictions"] > 0
    full.close()
    tiny.close()


@pytest.mark.parametrize("source", ["hf", "F32"])
def test_dense_layers_have_no_expert_blocks(made, source):
    src_path, pack_dir, _ = made[source]
    src, index = open_source(src_path), read_index(pack_dir)
    assert src.config.extra["moe_layers"] == [1, 3] and src.config.extra["dense_layers"] == [0, 2]
    for layer in (0, 2):
        assert index.layers[layer].offsets == () and index.layers[layer].block_nbytes == 0
        assert f"blk.{layer}.ffn_gate.weight" in src.common
    for layer in (1, 3):
        assert len(index.layers[layer].offsets) == src.config.n_experts
        assert f"blk.{layer}.ffn_gate_shexp.weight" in src.common
    kinds = {t.name for t in index.layers[1].tensors}
    assert kinds == ({"gate_up_t", "down_t"} if source == "hf" else {"gate", "up", "down"})
    facts = PackFacts.from_pack(pack_dir)
    assert facts.expert_bytes == sum(s * facts.n_experts for s in facts.slot_bytes)


def test_planned_kv_bytes_equal_allocation(made):
    _, pack_dir, _ = made["hf"]
    facts, cfg = PackFacts.from_pack(pack_dir), read_manifest(pack_dir).config
    for ctx, dtype in ((64, "float32"), (1000, "bfloat16")):
        plan = make_plan(facts, context=ctx, kv_dtype=dtype)
        assert plan.K == KVCache.for_config(cfg, ctx, getattr(torch, dtype), torch.device("cpu")).nbytes


def test_readers_agree_and_follow_llama_cpp(made):
    """HF and GGUF give the same layout; the GGUF side takes llama.cpp's fixed chunk, NoPE
    interval and temperature, and drops the qk norm at 128 experts as llama.cpp does."""
    hf_src, _, hf = made["hf"]
    a, b = open_source(hf_src).config, open_source(made["F32"][0]).config
    for k in ("moe_layers", "dense_layers", "dense_ff", "rope_layers", "chunk", "l2_qk_norm", "temperature"):
        assert a.extra[k] == b.extra[k], k
    assert (a.expert_ff, a.shared_ff, a.top_k, a.n_experts) == (b.expert_ff, b.shared_ff, b.top_k, b.n_experts)
    assert b.extra["chunk"] == [8192, 8192, 8192, None] and b.extra["rope_layers"] == [True, True, True, False]
    meta = {"general.architecture": "llama4", "llama4.block_count": 8, "llama4.embedding_length": 64,
            "llama4.attention.head_count": 4, "llama4.attention.head_count_kv": 2, "llama4.expert_count": 128,
            "llama4.expert_used_count": 1, "llama4.feed_forward_length": 96, "llama4.expert_feed_forward_length": 32,
            "llama4.interleave_moe_layer_step": 2}
    c = from_gguf_metadata(meta, 100)
    assert c.extra["l2_qk_norm"] is False and c.extra["moe_layers"] == [1, 3, 5, 7]
    assert c.extra["chunk"] == [8192, 8192, 8192, None] * 2
    with pytest.raises(UnsupportedError, match="sliding_window 0"):
        from_gguf_metadata(meta | {"llama4.attention.sliding_window": 0}, 100)
    # as the released config.json: the text model nested, derived lists absent (no_rope_layers
    # empty), RoPE under the older rope_scaling / rope_theta keys, attn_temperature_tuning an int
    raw = {k: v for k, v in fx.make_config().to_dict().items()
           if k not in ("moe_layers", "layer_types", "rope_parameters")}
    raw |= {"no_rope_layers": [], "attn_temperature_tuning": 4, "rope_theta": fx.ROPE["rope_theta"],
            "rope_scaling": {k: v for k, v in fx.ROPE.items() if k != "rope_theta"}}
    m = from_hf_config({"model_type": "llama4", "text_config": raw})
    for k in ("moe_layers", "rope_layers", "chunk", "temperature", "rope_scaling"):
        assert m.extra[k] == a.extra[k], k
    assert m.rope_base == a.rope_base and a.extra["rope_scaling"]["factor"] == 8.0


def test_multimodal_checkpoint_packs_its_text_model(made, tmp_path):
    """The released checkpoints are Llama4ForConditionalGeneration: config.json nests the text
    config, tensors live under language_model.model. / language_model.lm_head beside vision_model.*.
    The text model packs from such a directory and gives the same logits."""
    import json
    import shutil
    from safetensors.torch import load_file, save_file
    _, pack_dir, hf = made["hf"]
    mm = tmp_path / "mm"
    shutil.copytree(hf, mm)
    text = load_file(str(mm / "model.safetensors"))
    renamed = {("language_model." + k if k.startswith(("model.", "lm_head.")) else k): v for k, v in text.items()}
    renamed["vision_model.model.layers.0.mlp.fc1.weight"] = torch.zeros(4, 4)
    save_file(renamed, str(mm / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((mm / "config.json").read_text())
    (mm / "config.json").write_text(json.dumps({"model_type": "llama4", "architectures": ["Llama4ForConditionalGeneration"],
                                                "text_config": cfg, "tie_word_embeddings": False}))
    pack(mm, tmp_path / "pack", progress=False)
    a, b = runtime(pack_dir), runtime(tmp_path / "pack")
    assert torch.equal(a.forward(TOKENS, all_logits=True), b.forward(TOKENS, all_logits=True))
    a.close()
    b.close()
