"""What only Llama 4 has; its shared checks run from cases.CASES (row llama4_text, whose
hf_short_chunk source has chunk 5 and temperature floor 3). Here: exactness across chunk
boundaries, that the chunk mask and the NoPE temperature matter, the sigmoid weight on the expert
INPUT, HF's input-major experts, multimodal checkpoints, and the readers against llama.cpp's rules."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from bounds import F32_MODEL_ATOL, F32_SAME_OPS_ATOL
from . import api
from .cases import BY_ARCH, TOKENS
from .runtime_helpers import greedy, logits, open_rt

L4 = BY_ARCH["llama4_text"]


def test_chunked_attention_exact_across_chunk_boundaries(sources):
    """One token at a time and uneven prefill pieces cross chunk boundaries at other offsets than
    one batch; all equal the batch. Turning off the chunk mask or the NoPE temperature moves the
    logits by far more than the transformers bound, so the shared hf_short_chunk logits check
    depends on both."""
    rt = open_rt(sources.pack(L4, "hf_short_chunk"), "100")
    try:
        batch = rt.forward(list(TOKENS), all_logits=True)
        for pieces in ([7] + [1] * 33, [3, 4, 9, 8, 16], [5] * 8):
            rt.reset()
            got, at = [], 0
            for n in pieces:
                got.append(rt.forward(list(TOKENS[at:at + n]), all_logits=True))
                at += n
            torch.testing.assert_close(torch.cat(got), batch, rtol=0, atol=F32_SAME_OPS_ATOL)
        model, chunk, temp = rt.model, rt.model.chunk, rt.model.temp
        for name, off in (("chunk", [None] * len(chunk)), ("temp", None)):
            setattr(model, name, off)
            rt.reset()
            assert (rt.forward(list(TOKENS), all_logits=True) - batch).abs().max().item() > 100 * F32_MODEL_ATOL, name
            model.chunk, model.temp = chunk, temp
    finally:
        rt.close()


def test_routing_weight_scales_the_expert_input(sources):
    """sigmoid(logit) multiplies what the expert reads: weighting its output instead (the rule of
    the other families) gives other logits, so the transformers match pins the rule."""
    rt = open_rt(sources.pack(L4, "hf"), "100")
    try:
        want = rt.forward(list(TOKENS), all_logits=True)
        model, ffn = rt.model, rt.model.ffn

        def output_weighted(layer, x):
            if layer not in model.moe:
                return ffn(layer, x)
            idx, w = model.route(layer, x)
            return model._swiglu(x, layer, "_shexp") + model.experts(layer, x, idx, w)

        model.ffn = output_weighted
        rt.reset()
        assert (rt.forward(list(TOKENS), all_logits=True) - want).abs().max().item() > 100 * F32_MODEL_ATOL
    finally:
        rt.close()


def test_lookahead_asks_dense_layers_too(sources):
    """Next-layer router lookahead also runs before a dense layer (whose router answers no
    experts); greedy tokens at the smallest cache still equal those at the whole cache."""
    pack_dir = sources.pack(L4, "Q8_0")
    want, _ = greedy(pack_dir, TOKENS[:20], 12, "100")
    got, small = greedy(pack_dir, TOKENS[:20], 12, "min", lookahead=True)
    assert got == want and small["evictions"] > 0


@pytest.mark.parametrize("source,kinds", [("hf", {"gate_up_t", "down_t"}), ("F32", {"gate", "up", "down"})])
def test_expert_blocks_keep_the_source_layout(sources, source, kinds):
    """HF keeps experts fused and input-major (computed x @ W); GGUF has llama.cpp's gate/up/down."""
    index = api.read_index(sources.pack(L4, source))
    for layer in (1, 3):
        assert {t.name for t in index.layers[layer].tensors} == kinds
    src = api.open_source(sources.path(L4, source))
    assert src.config.extra["experts_input_major"] is (source == "hf")
    assert "blk.1.ffn_gate_shexp.weight" in src.common and "blk.0.ffn_gate.weight" in src.common


def test_multimodal_checkpoint_packs_its_text_model(sources, tmp_path):
    """The released checkpoints are Llama4ForConditionalGeneration: config.json nests the text
    config; tensors live under language_model.model. / language_model.lm_head beside vision_model.*."""
    hf = sources.path(L4, "hf")
    mm = tmp_path / "mm"
    shutil.copytree(hf, mm)
    text = load_file(str(mm / "model.safetensors"))
    renamed = {("language_model." + k if k.startswith(("model.", "lm_head.")) else k): v for k, v in text.items()}
    renamed["vision_model.model.layers.0.mlp.fc1.weight"] = torch.zeros(4, 4)
    save_file(renamed, str(mm / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((mm / "config.json").read_text())
    (mm / "config.json").write_text(json.dumps({"model_type": "llama4", "text_config": cfg,
                                                "architectures": ["Llama4ForConditionalGeneration"]}))
    api.pack(mm, tmp_path / "pack", progress=False)
    assert torch.equal(logits(tmp_path / "pack", TOKENS), logits(sources.pack(L4, "hf"), TOKENS))


def test_readers_agree_and_follow_llama_cpp(sources):
    """HF and GGUF give the same layout; the GGUF side takes llama.cpp's fixed chunk (8192), NoPE
    interval (4) and temperature (8192, 0.1) and drops the qk norm at 128 experts, as llama.cpp does."""
    a = api.open_source(sources.path(L4, "hf")).config
    b = api.open_source(sources.path(L4, "F32")).config
    for k in ("moe_layers", "dense_layers", "dense_ff", "rope_layers", "chunk", "l2_qk_norm", "temperature"):
        assert a.extra[k] == b.extra[k], k
    assert (a.expert_ff, a.shared_ff, a.top_k, a.n_experts) == (b.expert_ff, b.shared_ff, b.top_k, b.n_experts)
    assert b.extra["chunk"] == [8192, 8192, 8192, None] and b.extra["rope_layers"] == [True, True, True, False]
    meta = {"general.architecture": "llama4", "llama4.block_count": 8, "llama4.embedding_length": 64,
            "llama4.attention.head_count": 4, "llama4.attention.head_count_kv": 2, "llama4.expert_count": 128,
            "llama4.expert_used_count": 1, "llama4.feed_forward_length": 96, "llama4.expert_feed_forward_length": 32,
            "llama4.interleave_moe_layer_step": 2}
    c = api.from_gguf_metadata(meta, 100)
    assert c.extra["l2_qk_norm"] is False and c.extra["moe_layers"] == [1, 3, 5, 7]
    assert c.extra["chunk"] == [8192, 8192, 8192, None] * 2
    with pytest.raises(api.UnsupportedError, match="sliding_window 0"):
        api.from_gguf_metadata(meta | {"llama4.attention.sliding_window": 0}, 100)
    # as the released config.json: text model nested, derived lists absent (no_rope_layers empty),
    # RoPE under the older rope_scaling / rope_theta keys, attn_temperature_tuning an int
    raw = {k: v for k, v in api.fixture("llama4_text").make_config().to_dict().items()
           if k not in ("moe_layers", "layer_types", "rope_parameters")}
    rope = api.fixture("llama4_text").ROPE
    raw |= {"no_rope_layers": [], "attn_temperature_tuning": 4, "rope_theta": rope["rope_theta"],
            "rope_scaling": {k: v for k, v in rope.items() if k != "rope_theta"}}
    m = api.from_hf_config({"model_type": "llama4", "text_config": raw})
    for k in ("moe_layers", "rope_layers", "chunk", "temperature", "rope_scaling"):
        assert m.extra[k] == a.extra[k], k
    assert m.rope_base == a.rope_base and a.extra["rope_scaling"]["factor"] == 8.0
