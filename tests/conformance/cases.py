"""The architecture table: one ArchCase row per architecture, every shared conformance test
parametrized over it (as transformers' CausalLMModelTester: one row of class attributes per
model, one shared mixin of tests).

How to add a row (a new architecture `foo`):
  1. Write the architecture's fixture module, mawforge/fixtures/archs/<package name>.py (the
     name of its package in mawforge/archs/; the harness finds it by the row's HF model type):
     `build_hf(model_type, out_dir, **flags)`, `write_gguf(hf_dir, out_path, ftype)`, a
     transformers `load_hf(hf_dir)` and `add_mtp(hf_dir, model) -> modules` ("layer", "enorm",
     "hnorm", "norm", and "fc" or "eh_proj": test_mtp_shared's reference step), or
     `add_mtp = None` without MTP.
  2. Append `ArchCase("foo", ggufs=(...), llama=(Llama("F32"), ...), ...)` to
     CASES below (llama=() where the vendored llama.cpp lacks the arch; the fields are
     described where ArchCase declares them). Tolerances come from tests/bounds.py only; a
     llama.cpp min_top1 below 1.0 needs its measurement in a comment.
  3. Run `PYTHONPATH=$PWD python -m pytest tests/conformance -x -q -k foo`. Checks that only
     your family has go in tests/conformance/test_family_<name>.py.

Source names: "hf" (HF directory, the hub's per-expert layout), "hf_fused" (transformers 5.x
fused experts: build_hf(..., fused=True)), "hf_<flag>" (build_hf(arch, dir, <flag>=True), its own transformers
reference: "hf_yarn"), a GGUF ftype ("F32", "Q8_0", ...); "mtp:<source>" is the
same built from an HF directory that carries an MTP layer. GGUFs are written from "hf".
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bounds import F32_MODEL_ATOL, LLAMA_F32_ATOL

TOKENS = tuple(range(3, 43))        # 40 positions: past GPT-OSS's sliding window, across prefill chunks of 16
LONG_TOKENS = tuple(int(x) for x in np.random.default_rng(0).integers(5, 1000, 300))   # 300 random ids
DS_OSS_TOKENS = tuple(range(5, 29))  # 24 positions, the prompt the DeepSeek/GPT-OSS min_top1 were measured on


@dataclass(frozen=True)
class Llama:
    """llama.cpp teacher-forced top-1 agreement on one GGUF ftype (llama.cpp runs the arch)."""
    ftype: str
    min_top1: float = 1.0                   # share of positions whose top-1 equals llama.cpp's
    layouts: tuple[str, ...] = ("exact",)   # pack layouts compared on this GGUF
    # quantized: also within 0.03 of llama.cpp's own batched-vs-one-token agreement, >= 0.99 where
    # llama.cpp's top-2 margin >= 0.1 (see test_shared.test_llama_cpp_agrees_teacher_forced)
    self_check: bool = False
    # int4pack transcodes Q4_K to torch's int4 kernel with each scale and min rounded to bf16
    # (relative 2^-9 on top of llama.cpp's own rounding), so its fixed bound is this much lower;
    # the self-check bounds above still apply unchanged. Measured mixtral Q4_K_M int4pack: 0.9467
    # on AMD Zen 3 (AVX2 llama.cpp build, 2026-12-01) where llama.cpp agrees with itself on 0.97.
    int4pack_slack: float = 0.02
    # positions where llama.cpp's top-2 logits are closer than this are not counted against F16: both
    # round x to float16, the native F16 kernel sums its products in another float32 order than
    # ggml's (llamafile's tinyBLAS for a batch, 4 x 16 lanes for one row). Measured: max |logit diff|
    # 1.7e-3 / 1.9e-3 at qwen2_moe's / mixtral's one flipped position of 300 (top-2 margins 8.9e-4 /
    # 1.0e-3; qwen3_moe and olmoe agree at all 300); bound about 5x that.
    tie_margin: float = 0.0

    def bound(self, layout: str) -> float:
        return self.min_top1 - (self.int4pack_slack if layout == "int4pack" else 0.0)


@dataclass(frozen=True)
class ArchCase:
    arch: str                                   # HF model_type, the registry key
    hf: tuple[str, ...] = ("hf",)               # HF directory sources
    ggufs: tuple[str, ...] = ("F32",)           # GGUF ftypes written from "hf"
    logits: tuple[str, ...] = ("hf", "F32")     # packs whose float32 logits equal transformers' within logits_atol
    logits_atol: float = F32_MODEL_ATOL
    llama: tuple[Llama, ...] = ()               # empty: llama.cpp does not run this arch
    llama_tokens: tuple[int, ...] = TOKENS
    llama_f32_atol: float | None = LLAMA_F32_ATOL   # llama.cpp F32 vs transformers; None: not comparable
    transparent: tuple[str, ...] = ("F32",)     # greedy at the minimum cache == at the whole cache
    plan_source: str = "F32"                    # planned bytes == allocated bytes
    dense_layers: tuple[int, ...] = ()          # layers with a dense FFN (no expert blocks)
    mtp: tuple[str, ...] = ()                   # sources with an MTP layer: step vs reference, packed as common
    mtp_greedy: tuple[str, ...] = ()            # MTP sources whose greedy MTP decoding == plain decoding
    recurrent: bool = False                     # layers hold recurrent state (a verify step copies it)

    @property
    def id(self) -> str:
        return self.arch


_BASE_LLAMA = (Llama("F32"), Llama("F16", tie_margin=0.01), Llama("Q8_0", 0.95, self_check=True),
               Llama("Q4_K_M", 0.95, ("exact", "int4pack"), self_check=True))

# Every other quant type llama.cpp's quantizer writes into MoE models (mawforge/fixtures/requant.py:
# its ftype mix, or for IQ2 / IQ1 the experts by ggml_quantize_chunk over its Q4_K_M mix), on the
# native kernels of each (kernels/native/quant_types.h). Self-checked as Q4_K_M: within 0.03 of
# llama.cpp's own batched-vs-one-token agreement and >= 0.99 where its top-2 margin is >= 0.1.
# Measured top-1 on LONG_TOKENS (AMD EPYC Zen 4): 0.96 (IQ2_XS) to 0.997 (MXFP4_MOE, BF16), every
# type within 0.015 of llama.cpp's self-agreement and 1.0 on the clear positions; bound 0.9.
QUANT_TYPES = ("Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K_M", "IQ4_NL", "IQ4_XS", "IQ3_XXS", "IQ3_S", "IQ2_XXS",
               "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M", "MXFP4_MOE", "BF16")
_QUANT_LLAMA = tuple(Llama(f, 0.9, self_check=True) for f in QUANT_TYPES)

CASES: tuple[ArchCase, ...] = (
    # the four original archs (their fixture modules build on mawforge/fixtures/tiny.py); qwen3_moe
    # also carries every quant type's row
    *(ArchCase(a, hf=("hf", "hf_fused"), ggufs=("F32", "F16", "Q8_0", "Q4_K_M"),
               logits=("hf", "hf_fused", "F32"),
               llama=_BASE_LLAMA + (_QUANT_LLAMA if a == "qwen3_moe" else ()), llama_tokens=LONG_TOKENS,
               transparent=("Q4_K_M",)) for a in ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")),
    # DeepSeek V2/V3 (MLA, grouped routing, dense first layer) and GPT-OSS (sinks, sliding window,
    # MXFP4). Measured top-1 vs llama.cpp on DS_OSS_TOKENS: F32 1.00; Q8_0 and MXFP4 0.95 (llama.cpp
    # quantizes activations), bound 0.9 (on TOKENS, 2026-12-01: DeepSeek-V3 Q8_0 0.925, MXFP4 1.00).
    ArchCase("deepseek_v3", hf=("hf", "hf_yarn"), ggufs=("F32", "Q8_0"), logits=("hf", "hf_yarn", "F32"),
             llama=(Llama("F32"), Llama("Q8_0", 0.9)), llama_tokens=DS_OSS_TOKENS, transparent=("hf",),
             plan_source="hf", dense_layers=(0,), mtp=("mtp:hf", "mtp:F32", "mtp:Q8_0"),
             mtp_greedy=("mtp:hf", "mtp:Q8_0")),
    ArchCase("deepseek_v2", logits=("hf",), ggufs=(), llama_f32_atol=None, transparent=("hf",),
             plan_source="hf", dense_layers=(0,)),
    # GGUF F32 differs from HF by YaRN truncation (test_family_deepseek_gptoss), so only "hf" is exact
    ArchCase("gpt_oss", ggufs=("F32", "MXFP4"), logits=("hf",), llama=(Llama("F32"), Llama("MXFP4", 0.9)),
             llama_tokens=DS_OSS_TOKENS, transparent=("MXFP4",), plan_source="hf"),
    # Qwen3.5-MoE (gated delta-net hybrid, MTP) and Gemma 4 MoE. Measured top-1 vs llama.cpp on
    # these 40 positions: F32 40/40 both; Q8_0 qwen3_5_moe 39/40, gemma4 40/40.
    ArchCase("qwen3_5_moe", ggufs=("F32", "Q8_0"), llama=(Llama("F32"), Llama("Q8_0", 0.95)),
             transparent=("Q8_0",), mtp=("mtp:hf", "mtp:F32", "mtp:Q8_0"), mtp_greedy=("mtp:hf",), recurrent=True),
    ArchCase("gemma4", ggufs=("F32", "Q8_0"), llama=(Llama("F32"), Llama("Q8_0", 0.95)),
             transparent=("Q8_0",)),
    # GLM-4.5/4.6 MoE (grouped sigmoid routing, dense first layer, shared expert, partial RoPE, MTP).
    # Measured top-1 vs llama.cpp on these 40 positions: F32 40/40, Q8_0 40/40 (bound 0.95 as the others).
    # hf_air: GLM-4.5-Air's attention (no q/k norm).
    ArchCase("glm4_moe", hf=("hf", "hf_fused", "hf_air"), logits=("hf", "hf_fused", "hf_air", "F32"),
             ggufs=("F32", "Q8_0"), llama=(Llama("F32"), Llama("Q8_0", 0.95)),
             transparent=("hf", "Q8_0"), plan_source="hf", dense_layers=(0,),
             mtp=("mtp:hf", "mtp:F32", "mtp:Q8_0"), mtp_greedy=("mtp:hf", "mtp:Q8_0")),
    # Llama 4 MoE (interleaved dense/MoE layers, shared expert, sigmoid top-1 on the expert input,
    # chunked attention + NoPE layers; llama.cpp's fixed chunk 8192; hf_short_chunk: chunk 5 and
    # temperature floor 3, acting within the prompt). Measured max |diff| vs transformers 1.7e-6
    # (hf, hf_short_chunk), 1.4e-6 (F32); top-1 vs llama.cpp on these 40 positions: F32 40/40, Q8_0 40/40.
    ArchCase("llama4_text", hf=("hf", "hf_short_chunk"), ggufs=("F32", "Q8_0"),
             logits=("hf", "hf_short_chunk", "F32"), llama=(Llama("F32"), Llama("Q8_0", 0.95)),
             transparent=("hf", "Q8_0"), plan_source="hf", dense_layers=(0, 2)),
    # Qwen3-Next (mawforge/fixtures/archs/qwen3next.py): Qwen3.5's hybrid with fused qkvz/ba
    # delta-net projections. Measured top-1 vs llama.cpp on these 40 positions: F32 40/40, Q8_0 40/40.
    ArchCase("qwen3_next", ggufs=("F32", "Q8_0"), llama=(Llama("F32"), Llama("Q8_0", 0.95)),
             transparent=("Q8_0",), mtp=("mtp:hf", "mtp:F32", "mtp:Q8_0"), mtp_greedy=("mtp:hf",), recurrent=True),
)

BY_ARCH = {c.arch: c for c in CASES}


def rows(pred=lambda c: True) -> list[ArchCase]:
    return [c for c in CASES if pred(c)]


def pairs(field: str) -> list[tuple[ArchCase, str]]:
    """(row, item) for every item of a tuple field of every row: parametrize over (arch, source)."""
    return [(c, s) for c in CASES for s in getattr(c, field)]


def ids(params) -> list[str]:
    return ["-".join(str(getattr(p, "id", getattr(p, "ftype", p))) for p in (x if isinstance(x, tuple) else (x,)))
            for x in params]
