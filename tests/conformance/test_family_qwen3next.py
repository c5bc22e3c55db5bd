"""What only Qwen3-Next has beside its shared checks (cases.CASES row "qwen3_next"): the older
GGUF layout that keeps the fused qkvz projection as ssm_in, the config readers (grouped value
heads in both formats, the MTP block config.json does not count), delta-net state bytes, a
missing fused projection refused by name, and dense MLP layers refused (llama.cpp has no dense
path for this arch)."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from bounds import F32_MODEL_ATOL, LLAMA_F32_ATOL
from . import api
from .cases import BY_ARCH, TOKENS
from .runtime_helpers import logits

Q3N = BY_ARCH["qwen3_next"]


def test_legacy_fused_gguf_matches_transformers_and_llama_cpp(sources, tmp_path):
    """ssm_in (HF in_proj_qkvz unchanged) instead of attn_qkv + attn_gate: llama.cpp reads both,
    and so does models/deltanet.py. Measured: 2.2e-6 from transformers, top-1 40/40 and
    max |diff| 5.2e-4 against llama.cpp."""
    gguf = api.fixture("qwen3_next").write_gguf(sources.path(Q3N, "hf"), tmp_path / "legacy.gguf", "F32", legacy=True)
    api.pack(gguf, tmp_path / "pack", progress=False)
    assert "blk.0.ssm_in.weight" in {r.name for r in api.read_manifest(tmp_path / "pack").common}
    got = logits(tmp_path / "pack", TOKENS)
    torch.testing.assert_close(got, sources.hf_logits(Q3N), rtol=0, atol=F32_MODEL_ATOL)
    ref = api.llama_logits(gguf, list(TOKENS), n_ctx=320)
    assert (ref.argmax(-1) == got.numpy().argmax(-1)).all()
    assert np.abs(ref - got.numpy()).max() < LLAMA_F32_ATOL


def test_configs_from_hf_and_gguf_agree(sources):
    q = api.from_hf_config(json.loads((sources.path(Q3N, "hf") / "config.json").read_text()))
    assert q.arch == "qwen3next" and q.extra["layer_types"] == ["linear", "full", "linear", "full"]
    assert q.extra["rope_dim"] == 8 and q.extra["norm_offset"] == 1.0 and q.extra["mtp_layers"] == 1
    assert q.extra["linear"] == {"k_heads": 2, "v_heads": 4, "k_dim": 32, "v_dim": 32, "conv": 4, "v_order": "grouped"}
    for src in Q3N.ggufs:
        g = api.read_manifest(sources.pack(Q3N, src)).config
        assert g.extra["kv_layers"] == q.extra["kv_layers"] and g.extra["linear"] == q.extra["linear"]
        assert g.extra["norm_offset"] == 0.0 and g.extra["mtp_layers"] == 0      # the converter stores 1 + w
    common = {r.name for r in api.read_manifest(sources.pack(Q3N, "hf")).common}
    assert {"blk.0.ssm_in.weight", "blk.0.ssm_ba.weight"} <= common            # HF's fused projections, kept fused
    assert "blk.1.ssm_in.weight" not in common and "blk.1.attn_q.weight" in common


def test_kv_grows_only_in_attention_layers(sources):
    facts = api.PackFacts.from_pack(sources.pack(Q3N, "F32"))
    k1, k2 = (api.make_plan(facts, context=n).K for n in (100, 200))
    per_pos = 2 * 2 * 2 * 32 * 4                   # 2 full-attention layers, K and V, 2 kv heads of 32, f32
    assert k2 - k1 == 100 * per_pos
    conv, state = (2 * 2 * 32 + 4 * 32) * 3, 4 * 32 * 32
    assert k1 - 100 * per_pos == 2 * 4 * (conv + state)   # two delta-net layers hold fixed state


@pytest.mark.parametrize("change", [{"mlp_only_layers": [0]}, {"decoder_sparse_step": 2}])
def test_dense_layers_are_refused(sources, change):
    c = json.loads((sources.path(Q3N, "hf") / "config.json").read_text())
    with pytest.raises(api.UnsupportedError, match="dense MLP layers"):
        api.from_hf_config(c | change)


def test_missing_fused_projection_fails_at_pack(sources, tmp_path):
    """A delta-net layer without in_proj_ba is refused at pack time naming llama.cpp's ssm_ba."""
    shutil.copytree(sources.path(Q3N, "hf"), tmp_path / "hf")
    path = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(str(path))
    del tensors["model.layers.0.linear_attn.in_proj_ba.weight"]
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(api.MawError, match=r"no blk\.0\.ssm_ba\.weight tensor"):
        api.pack(tmp_path / "hf", tmp_path / "pack", progress=False)
