"""The shared conformance checks, each parametrized over the rows of cases.CASES: logits against
transformers (F32), llama.cpp on the same GGUF (teacher-forced), cache transparency, layer-major
prefill against chunk by chunk, planned bytes == allocated bytes, dense layers, and a missing
tensor failing at load."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from bounds import DEQUANT_FLOOR, F32_MODEL_ATOL

from . import api
from .cases import CASES, TOKENS, ids, pairs, rows
from .runtime_helpers import greedy, logits, open_rt

LLAMA = [(c, chk) for c in CASES for chk in c.llama]
LLAMA_LAYOUTS = [(c, chk, lay) for c, chk in LLAMA for lay in chk.layouts]


@pytest.mark.parametrize("case,source", pairs("logits"), ids=ids(pairs("logits")))
def test_f32_logits_match_transformers(sources, case, source):
    """Bound F32_MODEL_ATOL (tests/bounds.py); measured max |diff| printed (-s)."""
    got = logits(sources.pack(case, source), TOKENS)
    print(f"{case.arch} {source}: max |diff| {(got - sources.hf_logits(case, source)).abs().max().item():.1e}")
    torch.testing.assert_close(got, sources.hf_logits(case, source), rtol=0, atol=case.logits_atol)


@pytest.mark.parametrize("case",
                         rows(lambda c: c.llama_f32_atol is not None and any(k.ftype == "F32" for k in c.llama)),
                         ids=lambda c: c.id)
def test_llama_cpp_f32_logits_match_transformers(sources, case):
    """The reference itself: llama.cpp on the F32 GGUF against transformers on the HF directory
    (llama.cpp keeps K/V in float16: LLAMA_F32_ATOL). MawForge is within F32_MODEL_ATOL of
    transformers (above), so this also bounds MawForge against llama.cpp."""
    ref = sources.hf_logits(case).numpy()
    got = sources.llama(case, "F32", TOKENS)
    assert got.shape == ref.shape
    print(f"{case.arch}: llama.cpp F32 vs transformers max |diff| {np.abs(got - ref).max():.1e}")
    np.testing.assert_allclose(got, ref, atol=case.llama_f32_atol, rtol=0)


@pytest.mark.parametrize("case,check,layout", LLAMA_LAYOUTS, ids=ids(LLAMA_LAYOUTS))
def test_llama_cpp_agrees_teacher_forced(sources, case, check, layout):
    """Top-1 agreement with llama.cpp (the prompt in one batch) on the same GGUF.

    F32 agrees at every position; F16 at every position but near-ties, where llama.cpp's two best
    logits are within Llama.tie_margin (both round activations to float16; the native F16 kernel
    sums in another float32 order than ggml's). Quantized: the exact layout computes every quantized
    matmul's integers as ggml does
    (tests/test_native.py), but after the first float-order difference flips one q8 rounding the
    models drift apart by ~0.05 of logit, and random tiny models are full of near-ties. llama.cpp
    does not agree with itself more closely: its batched and one-token-at-a-time evaluations of
    the same file agree on 96.7-99.7% of positions. With self_check the agreement must be within
    0.03 of that (3 sigma of a rate near 0.97 over 300 positions), and >= 99% where llama.cpp's
    top-2 margin is at least 0.1 (twice the drift, so a drift alone cannot flip those)."""
    tokens = case.llama_tokens
    ref = sources.llama(case, check.ftype, tokens)
    got = logits(sources.pack(case, check.ftype, layout), tokens, budget="50", context=320, prefill_chunk=64).numpy()
    agree = got.argmax(-1) == ref.argmax(-1)
    print(f"{case.arch} {check.ftype} {layout}: top-1 agreement {agree.mean():.4f} over {len(tokens)} positions")
    top2 = np.sort(ref, -1)[:, -2:]
    margin = top2[:, 1] - top2[:, 0]
    for i in np.flatnonzero(~agree):
        diff = np.abs(got[i] - ref[i]).max()
        print(f"  position {i}: llama.cpp's top-2 margin {margin[i]:.2e}, max |diff| {diff:.2e}")
    # a near-tie (llama.cpp's two best within tie_margin) may flip with the float order alone
    assert (agree | (margin < check.tie_margin)).mean() >= check.bound(layout)
    if check.self_check:
        seq = sources.llama(case, check.ftype, tokens, n_batch=1)
        own = (seq.argmax(-1) == ref.argmax(-1)).mean()
        top2 = np.sort(ref, -1)[:, -2:]
        clear = (top2[:, 1] - top2[:, 0]) >= 0.1
        print(f"  llama.cpp batched vs one token at a time: {own:.4f}; {agree[clear].mean():.4f} over "
              f"{clear.sum()} clear positions")
        assert agree.mean() >= own - 0.03
        assert agree[clear].mean() >= 0.99


Q8_ROWS = rows(lambda c: any(k.ftype == "F32" for k in c.llama) and not c.arch.startswith("deepseek"))


@pytest.mark.parametrize("case", Q8_ROWS, ids=lambda c: c.id)
def test_q8_0_kv_cache_agrees_with_llama_cpp_q8_0(sources, case):
    """`kv_dtype="q8_0"` against llama.cpp's `--cache-type-k/v q8_0` (flash attention, which a
    quantized V needs) on the same F32 GGUF, the prompt in chunks, then 8 native decode steps.
    Both quantize each cached row with ggml's x86 quantize_row_q8_0 and rotate keys, queries and
    values by the same Walsh-Hadamard matrices where the head dim is a multiple of 64 (the rows of
    heads of 64 here; tests/test_native.py pins the bytes, the rotation and the attention). The two
    then differ by float32 order and the 8-bit roundings it flips: measured max |diff| 1.9e-6 -
    7e-2, at most 0.09 of how far q8_0 itself moves llama.cpp's logits from its float16 cache's
    (8e-3 - 0.86; bound 0.15); top-1 equal at every position on AVX-512 CPUs. On AMD Zen 3 (AVX2,
    where ggml sums its q8_0 dot products in another order) llama4_text's rows differ by 1.4e-3 and
    one position of 40 in a near-tie flips: top-1 is held equal wherever llama.cpp's two best logits
    are more than twice the largest difference apart (and that must be 90% of the positions).
    With llama.cpp's rotation off (LLAMA_ATTN_ROT_DISABLE) the rows of heads of 64 differ by
    0.05-0.1, printed with -s. (DeepSeek's latent rows of 80 values take no q8_0 cache:
    test_prompt_cache_rows.)"""
    tokens = case.llama_tokens[:48]
    cut = len(tokens) - 8
    ref = sources.llama(case, "F32", tokens, cache_type="q8_0")
    rt = open_rt(sources.pack(case, "F32"), "100", context=96, prefill_chunk=16, kv_dtype="q8_0")
    try:
        got = rt.forward(list(tokens[:cut]), all_logits=True)
        steps = [rt.forward([t], kind="decode")[0] for t in tokens[cut:]]       # the native decode step's rows
    finally:
        rt.close()
    got = torch.cat((got, torch.stack(steps))).numpy()
    unrotated = sources.llama(case, "F32", tokens, cache_type="q8_0", attn_rot=False)
    f16 = sources.llama(case, "F32", tokens)
    diff, effect = np.abs(got - ref).max(), np.abs(ref - f16).max()
    agree = (got.argmax(-1) == ref.argmax(-1)).mean()
    print(f"{case.arch} q8_0: max |diff| {diff:.1e}, top-1 {agree:.3f}; q8_0 against float16 {effect:.1e}; "
          f"llama.cpp's rotation off: {np.abs(got - unrotated).max():.1e}")
    assert diff <= 0.15 * effect
    # top-1 equal wherever llama.cpp's two best logits are further apart than the two engines'
    # largest difference: only there can float32 order not flip the pick
    top2 = np.sort(ref, -1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 2 * diff
    print(f"  top-1 {(got.argmax(-1) == ref.argmax(-1))[clear].mean():.3f} over {clear.sum()} of {len(clear)} "
          f"positions whose margin exceeds 2 x max |diff|; the least margin {(top2[:, 1] - top2[:, 0]).min():.1e}")
    assert clear.mean() >= 0.9
    assert (got.argmax(-1) == ref.argmax(-1))[clear].all()


@pytest.mark.parametrize("case", rows(lambda c: c.llama), ids=lambda c: c.id)
def test_every_gguf_generates_in_llama_cpp(sources, case):
    paths = [sources.path(case, chk.ftype) for chk in case.llama]
    vocab = api.read_manifest(sources.pack(case, case.llama[0].ftype)).config.vocab
    for path, out in zip(paths, api.llama_generate_many(paths, "Hello world", max_tokens=6)):
        assert len(out["tokens"]) > 0, path
        assert all(0 <= t < vocab for t in out["tokens"])


@pytest.mark.parametrize("case,source", pairs("transparent"), ids=ids(pairs("transparent")))
def test_cache_is_transparent_at_its_minimum(sources, case, source):
    """Greedy tokens at the plan's smallest expert cache (evicting) equal those of a cache that
    holds every expert (never evicting); a second request starts from reset state."""
    pack_dir = sources.pack(case, source)
    facts = api.PackFacts.from_pack(pack_dir)
    prompt = TOKENS[:20]
    want, full = greedy(pack_dir, prompt, 12, "100")
    got, small = greedy(pack_dir, prompt, 12, "min")
    assert small["capacity_bytes"] == facts.min_cache_bytes < facts.expert_bytes
    assert got == want and len(want) == 12
    assert small["evictions"] > 0 and full["evictions"] == 0
    assert greedy(pack_dir, prompt, 12, "100")[0] == want


WAVE_SOURCES = [(c, c.transparent[0]) for c in CASES]     # a GGUF quant pack where the row has one


@pytest.mark.parametrize("case,source", WAVE_SOURCES, ids=ids(WAVE_SOURCES))
def test_layer_major_prefill_gives_the_logits_of_chunk_by_chunk(sources, case, source):
    """A prompt run layer by layer (engine/runtime.py waves: attention 8 queries at a time, the
    experts once over the whole wave) against the same prompt run one chunk at a time through
    every layer (a wave of one chunk), at a cache that evicts, in one wave and in waves of two
    chunks (the KV and recurrent state carry across waves). Every GEMM whose row count changes
    (an expert's tokens, the router's, a shared expert's) gives each row the same bits whatever
    the count on the native integer kernels, so a pack of their types whose FFN has no float32
    GEMM (qwen2_moe's shared-expert gate is one) gives the same bits. torch's float32 GEMMs
    block by the row count: within F32_MODEL_ATOL (measured 1.1e-6 .. 1.4e-6, as today's
    prefill across --prefill-chunk sizes). Expert types the native kernels do not take (MXFP4)
    multiply in bf16 once an expert has more than GGML_FP32_MAX_M = 16 tokens (kernels/cpu.py),
    as in any chunk of more than 16 today: within DEQUANT_FLOOR (the bound for bf16-rounded
    activations; measured 2.4e-3)."""
    pack_dir = sources.pack(case, source)
    common = {r.name for r in api.read_manifest(pack_dir).common}
    qtypes = {t.qtype for lb in api.read_index(pack_dir).layers for t in lb.tensors}
    floats = qtypes <= {"F32", "F16", "BF16"}
    native = qtypes <= {"Q4_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K"}
    exact = native and not any("ffn_gate_inp_shexp" in n for n in common)
    atol = F32_MODEL_ATOL if floats or native else DEQUANT_FLOOR
    want = logits(pack_dir, TOKENS, budget="min", prefill_chunk=8, prefill_wave=8)
    for wave in (16, 2048):
        got = logits(pack_dir, TOKENS, budget="min", prefill_chunk=8, prefill_wave=wave)
        print(f"{case.arch} {source} wave {wave}: max |diff| {(got - want).abs().max().item():.1e}")
        if exact:
            assert torch.equal(got, want), (wave, (got - want).abs().max().item())
        torch.testing.assert_close(got, want, rtol=0, atol=atol)
        assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_planned_bytes_equal_allocations(sources, case):
    """The plan's C, E and K are the bytes the runtime allocates, and K(n) is what the KV cache
    allocates for that context and dtype."""
    pack_dir = sources.pack(case, case.plan_source)
    rt = open_rt(pack_dir, "50", context=64)
    try:
        assert rt.plan.K == rt.kv.nbytes
        assert rt.plan.C == rt.weights.resident_bytes
        assert rt.plan.E == rt.cache.stats()["capacity_bytes"]
    finally:
        rt.close()
    facts, cfg = api.PackFacts.from_pack(pack_dir), api.read_manifest(pack_dir).config
    for ctx, dtype in ((64, "float32"), (1000, "bfloat16"), (1000, "q8_0")):
        if dtype == "q8_0" and case.arch.startswith("deepseek"):    # latent rows of 80: test_prompt_cache_rows
            continue
        plan = api.make_plan(facts, context=ctx, kv_dtype=dtype)
        assert plan.K == api.KVCache.for_config(cfg, ctx, dtype, torch.device("cpu")).nbytes
    if not case.arch.startswith("deepseek"):   # a position's rows: 34 bytes a 32 values in q8_0, 64 in bfloat16
        per = {dt: api.make_plan(facts, context=1000, kv_dtype=dt).K - api.make_plan(facts, context=1, kv_dtype=dt).K
               for dt in ("q8_0", "bfloat16")}
        assert per["q8_0"] * 64 == per["bfloat16"] * 34 > 0


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_dense_layers_have_no_expert_blocks(sources, case):
    pack_dir = sources.pack(case, case.plan_source)
    index, cfg = api.read_index(pack_dir), api.read_manifest(pack_dir).config
    for i, lb in enumerate(index.layers):
        if i in case.dense_layers:
            assert lb.offsets == () and lb.block_nbytes == 0, i
            assert f"blk.{i}.ffn_gate.weight" in {r.name for r in api.read_manifest(pack_dir).common}
        else:
            assert len(lb.offsets) == cfg.n_experts, i
    facts = api.PackFacts.from_pack(pack_dir)
    assert facts.expert_bytes == sum(s * facts.n_experts for s in facts.slot_bytes)


def _drop_one_attention_output(hf, out) -> str:
    shutil.copytree(hf, out)
    tensors = load_file(str(out / "model.safetensors"))
    name = next(n for n in sorted(tensors) if ".layers.1." in n and n.endswith("o_proj.weight"))
    del tensors[name]
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return name


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_missing_tensor_fails_at_pack(sources, case, tmp_path):
    """A source without one layer's attention output projection is refused before anything runs,
    naming the tensor (mawforge/formats/required.py), never mid-decode. A pack damaged after
    packing is caught by its digests (tests/test_runtime.py)."""
    _drop_one_attention_output(sources.path(case, "hf"), tmp_path / "hf")
    with pytest.raises(api.MawError, match=r"no blk\.1\.attn_output\.weight tensor"):
        api.pack(tmp_path / "hf", tmp_path / "pack", progress=False)
