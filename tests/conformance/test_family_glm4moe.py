"""What only GLM-4.5/4.6 MoE has; its shared checks (transformers, llama.cpp, cache transparency,
plan, dense layer, MTP) run from its cases.CASES row: the fused expert layout, the Air's
attention without q/k norm, one config from both readers, and M-RoPE conversions refused."""
from __future__ import annotations

import pytest
import torch

from bounds import F32_MODEL_ATOL
from . import api
from .cases import BY_ARCH, TOKENS
from .runtime_helpers import logits

GLM = BY_ARCH["glm4_moe"]


def _hf_logits(hf) -> torch.Tensor:
    with torch.no_grad():
        return api.tiny.load_hf(hf)(torch.tensor([list(TOKENS)])).logits[0].float()


@pytest.mark.parametrize("variant", ["fused", "no_qk_norm"])
def test_variant_matches_transformers(tmp_path, variant):
    """transformers 5.x's fused experts (mlp.experts.gate_up_proj / down_proj), and GLM-4.5-Air's
    attention (use_qk_norm false: no attn_q_norm / attn_k_norm, which the model then skips)."""
    hf = api.glm4moe.build_hf("glm4_moe", tmp_path / "hf", qk_norm=variant != "no_qk_norm")
    if variant == "fused":
        api.tiny.fuse_experts(hf / "model.safetensors", api.glm4moe.N_EXPERTS)
    api.pack(hf, tmp_path / "pack", progress=False)
    common = {r.name for r in api.read_manifest(tmp_path / "pack").common}
    assert ("blk.1.attn_q_norm.weight" in common) == (variant != "no_qk_norm")
    torch.testing.assert_close(logits(tmp_path / "pack", TOKENS), _hf_logits(hf), rtol=0, atol=F32_MODEL_ATOL)


def test_hf_and_gguf_read_the_same_config(sources):
    """Dense layer 0, the grouped router, RoPE on 16 of 32 head dims, the shared expert's width."""
    a, b = (api.read_manifest(sources.pack(GLM, s)).config.to_dict() for s in ("hf", "F32"))
    assert b.pop("norm_eps") == pytest.approx(a.pop("norm_eps"), rel=1e-7)      # GGUF stores float32
    assert a == b
    x = a["extra"]
    assert x["dense_layers"] == list(GLM.dense_layers) and x["rope_dim"] == api.glm4moe.HEAD_DIM // 2
    assert x["router"] == {"groups": 4, "groups_used": 2, "scale": 2.5}
    assert a["shared_ff"] == 64 and a["qkv_bias"] and a["norm_topk_prob"]


def test_mrope_conversion_is_refused(sources, tmp_path):
    """A GLM-4.5V conversion carries M-RoPE sections; refused naming them, not run as plain RoPE."""
    path = api.glm4moe.write_gguf(sources.path(GLM, "hf"), tmp_path / "v.gguf", "F32", mrope_sections=[8, 4, 4, 0])
    with pytest.raises(api.UnsupportedError, match="M-RoPE"):
        api.open_source(path)
