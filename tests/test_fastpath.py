"""The one-token decode shortcuts (models/fastpath.py, the MoE block's bound expert pointers):
taken where their conditions hold, never elsewhere, and the same bits as the separate calls."""
from __future__ import annotations

import pytest
import torch

from helpers import needs_cc
from mawforge.engine.runtime import Runtime, RuntimeOptions
from mawforge.models.base import MoETransformer
from mawforge.models.fastpath import DecodeAttention

PROMPT = list(range(3, 20))
DECODE = [5, 40, 7, 33, 2, 61, 11, 19]


def _decode_logits(pack, fast: bool) -> list[torch.Tensor]:
    rt = Runtime(pack, RuntimeOptions(context=128, prefill_chunk=8, expert_cache_percent=100))
    try:
        if not fast:
            rt.model.decode_attention = None
        out = [rt.forward(PROMPT)]
        out += [rt.forward([t], kind="decode") for t in DECODE]
        return out
    finally:
        rt.close()


@needs_cc
@pytest.mark.parametrize("arch", ["qwen3_moe", "olmoe", "qwen2_moe", "mixtral"])
@pytest.mark.parametrize("source", ["Q4_K_M", "Q8_0"])
def test_fused_attention_step_gives_the_same_bits(packs, arch, source):
    """Per-head (Qwen3), whole-projection (OLMoE) and no q/k norm with biases (Qwen2-MoE) or
    interleaved RoPE (Mixtral's GGUF layout) all take the fused call, and every decode step's
    logits equal the separate calls' bit for bit."""
    pack = packs[(arch, source)]
    rt = Runtime(pack, RuntimeOptions(context=64, expert_cache_percent=100))
    try:
        assert rt.model.decode_attention is not None
        # the whole layer up to the experts is one call too, and routes where the router is float32
        assert rt.model.decode_attention.whole is not None
        assert rt.model.decode_attention.routes
    finally:
        rt.close()
    fast, slow = _decode_logits(pack, True), _decode_logits(pack, False)
    for a, b in zip(fast, slow):
        assert torch.equal(a, b)


@needs_cc
@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16", "float32"])
def test_a_decode_step_is_one_native_call_a_layer_before_the_experts(packs, kv_dtype, monkeypatch):
    """A decode step calls decode_layer once a layer and none of the separate attention, norm
    or routing calls; with each KV dtype the logits and the cache contents are the separate
    calls' bits."""
    from mawforge.kernels import native
    pack = packs[("qwen3_moe", "Q4_K_M")]
    runs = {}
    for fast in (True, False):
        rt = Runtime(pack, RuntimeOptions(context=64, prefill_chunk=8, expert_cache_percent=100, kv_dtype=kv_dtype,
                                          prefetch="none"))
        try:
            if not fast:
                rt.model.decode_attention = None
            logits = [rt.forward(PROMPT)]
            calls = {}
            for name in ("decode_layer", "attn_qkv", "attend_rows", "route_topk", "rms_norm"):
                real = getattr(native, name)
                monkeypatch.setattr(native, name, lambda *a, real=real, name=name: (
                    calls.__setitem__(name, calls.get(name, 0) + 1), real(*a))[1])
            logits += [rt.forward([t], kind="decode") for t in DECODE]
            monkeypatch.undo()
            n = rt.cfg.n_layers * len(DECODE)
            if fast:
                assert calls == {"decode_layer": n, "rms_norm": len(DECODE)}     # + the output norm
            else:
                assert "attn_qkv" not in calls and "decode_layer" not in calls
                assert calls["attend_rows"] == n and calls["route_topk"] == n
            end = rt.kv.pos
            runs[fast] = (logits, [t[:, :end].clone() for t in rt.kv.k + rt.kv.v])
        finally:
            rt.close()
    for a, b in zip(runs[True][0], runs[False][0]):
        assert torch.equal(a, b)
    for a, b in zip(runs[True][1], runs[False][1]):
        assert a.dtype == getattr(torch, kv_dtype) and torch.equal(a, b)


def test_float_weights_and_overridden_hooks_keep_the_separate_calls(packs):
    """F32 projections (no native rows), a family that overrides qk_norm or attention, and a
    subclass that overrides a hook the fused call replaces: no fast path."""
    rt = Runtime(packs[("qwen3_moe", "F32")], RuntimeOptions(context=64, expert_cache_percent=100))
    try:
        assert rt.model.decode_attention is None
    finally:
        rt.close()
    rt = Runtime(packs[("qwen3_moe", "Q4_K_M")], RuntimeOptions(context=64, expert_cache_percent=100))
    try:
        model = rt.model
        assert DecodeAttention.plan(model) is not None
        for hook in ("qk_norm", "attention", "proj", "mixer"):
            base = getattr(MoETransformer, hook)
            sub = type("Custom", (type(model),), {hook: lambda self, *a, base=base: base(self, *a)})
            model.__class__ = sub
            try:
                assert DecodeAttention.plan(model) is None, hook
            finally:
                model.__class__ = sub.__mro__[1]
    finally:
        rt.close()


@pytest.mark.parametrize("arch", ["glm4_moe", "qwen3_5_moe", "gemma4", "gpt_oss", "deepseek_v2"])
def test_families_with_their_own_attention_do_not_take_it(arch):
    """Families whose attention or q/k norm differ are never planned (checked on the class)."""
    from mawforge.archs import HF_MODEL_TYPES, get
    cls = get(HF_MODEL_TYPES[arch]).model_class()
    assert any(getattr(cls, f) is not getattr(MoETransformer, f) for f in ("attention", "qk_norm", "mixer"))


def test_a_resident_model_issues_no_prefetch_and_keeps_its_tokens(packs):
    """With every block resident nothing can be loaded or evicted, so `auto` prefetch (and its
    router lookahead) is skipped: no probes are counted, and the logits are those of a runtime
    without prefetch."""
    pack = packs[("qwen3_moe", "Q4_K_M")]
    out = {}
    for prefetch in ("auto", "none"):
        rt = Runtime(pack, RuntimeOptions(context=128, prefill_chunk=8, expert_cache_percent=100, prefetch=prefetch))
        try:
            rt.cache.preload()
            assert rt.cache.complete()
            before = rt.cache.stats()
            out[prefetch] = [rt.forward(PROMPT)] + [rt.forward([t], kind="decode") for t in DECODE]
            after = rt.cache.stats()
            assert after["prefetch_probes"] == before["prefetch_probes"]
            assert after["prefetch_issued"] == before["prefetch_issued"] and after["misses"] == before["misses"]
        finally:
            rt.close()
    assert all(torch.equal(a, b) for a, b in zip(out["auto"], out["none"]))
