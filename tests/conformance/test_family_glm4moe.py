"""What only GLM-4.5/4.6 MoE has; its shared checks (transformers on hf, hf_fused, hf_air and
F32, llama.cpp, cache transparency, plan, dense layer, MTP) run from its cases.CASES row: the
Air's attention packed without q/k norm, one config from both readers, M-RoPE conversions refused."""
from __future__ import annotations

import pytest

from . import api
from .cases import BY_ARCH

GLM = BY_ARCH["glm4_moe"]


def test_air_has_no_qk_norm(sources):
    """GLM-4.5-Air (use_qk_norm false) packs without attn_q_norm / attn_k_norm and the model skips
    them (its logits: test_shared's hf_air row); GLM-4.5 / 4.6 keep them."""
    for source, has in (("hf", True), ("hf_air", False)):
        common = {r.name for r in api.read_manifest(sources.pack(GLM, source)).common}
        assert ("blk.1.attn_q_norm.weight" in common) == ("blk.1.attn_k_norm.weight" in common) == has, source


def test_hf_and_gguf_read_the_same_config(sources):
    """Dense layer 0, the grouped router, RoPE on 16 of 32 head dims, the shared expert's width."""
    a, b = (api.read_manifest(sources.pack(GLM, s)).config.to_dict() for s in ("hf", "F32"))
    assert b.pop("norm_eps") == pytest.approx(a.pop("norm_eps"), rel=1e-7)      # GGUF stores float32
    assert a == b
    x = a["extra"]
    assert x["dense_layers"] == list(GLM.dense_layers) and x["rope_dim"] == api.fixture("glm4_moe").HEAD_DIM // 2
    assert x["router"] == {"groups": 4, "groups_used": 2, "scale": 2.5}
    assert a["shared_ff"] == 64 and a["qkv_bias"] and a["norm_topk_prob"]


def test_mrope_conversion_is_refused(sources, tmp_path):
    """A GLM-4.5V conversion carries M-RoPE sections; refused naming them, not run as plain RoPE."""
    path = api.fixture("glm4_moe").write_gguf(sources.path(GLM, "hf"), tmp_path / "v.gguf", "F32",
                                              mrope_sections=[8, 4, 4, 0])
    with pytest.raises(api.UnsupportedError, match="M-RoPE"):
        api.open_source(path)
