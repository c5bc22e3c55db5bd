"""Every numeric tolerance the tests use, each derived from something stated: the float format's
rounding, a quantization format's step, or a reference's own spread measured in the same run.
None is tuned to a CPU: where two CPUs differ (AVX-512 vs AMX Xeon, AVX2 vs scalar), they differ
in summation order only, which these bounds cover by construction.

eps32 = 2^-24 ≈ 6.0e-8 is float32's unit roundoff, eps16 = 2^-11 ≈ 4.9e-4 float16's,
epsbf16 = 2^-8 ≈ 3.9e-3 bfloat16's. A dot product of length K summed in another order differs by
about sqrt(K)·eps·|terms| (random-walk rounding; K·eps is the worst case).
"""
from __future__ import annotations

# Float32 against float32 through a whole tiny model (hidden <= 256, FFN <= 512, <= 4 layers,
# logits |z| <= ~8): the same arithmetic, summed in another order (torch vs our loops, MKL vs
# oneDNN blocking). Per dot product sqrt(512)·eps32 ≈ 1.4e-6 relative; through residual streams
# of |h| <= ~10 and <= 4 layers that is <= ~6e-5 of logit. Measured 3e-6 .. 5e-6.
F32_MODEL_ATOL = 1e-4

# Float32, the same operations on the same values in two layouts (fused vs split experts,
# a recurrent state replayed vs kept): one GEMM blocking against another, no layer compounding
# beyond the first: sqrt(512)·eps32·|x <= 8| ≈ 1e-5.
F32_SAME_OPS_ATOL = 1e-5

# llama.cpp F32 against transformers: llama.cpp keeps K and V in a float16 cache (its default
# KV type), so every attention input is rounded to eps16 ≈ 4.9e-4 relative; through softmax and
# the output projection that is ~|z| · eps16 · sqrt(layers) ≈ 8 · 4.9e-4 · 2 ≈ 8e-3 of logit.
LLAMA_F32_ATOL = 1e-2

# One native (C) kernel against the same integer arithmetic in another summation order (fused
# expert call vs per-expert calls; scalar vs AVX2 build; ggml's batched kernels at M > 4):
# the integer block dots are exact, only the float32 sum of per-block terms is reordered:
# K/32 <= 16 terms -> sqrt(16)·eps32 ≈ 2.4e-7 relative of the row's magnitude. The bounds give
# a 4x margin: rtol 1e-5 elementwise, atol 1e-6 of the largest output for a plain GEMM.
NATIVE_REORDER_RTOL = 1e-5
NATIVE_REORDER_ATOL_OF_MAX = 1e-6
# llama.cpp's q8 activation scale d = amax/127 is one float32 division; ours the same division:
# equal to the last bit, so the only allowance is one ulp (eps32·2 ≈ 1.2e-7).
ACT_SCALE_REL = 1.2e-7
# RMSNorm: C sums x^2 in order (as ggml), torch in float64 in another order; both round the
# mean to float32 once: one float32 ulp of the normalized value, 2·eps32 ≈ 1.2e-7, times the
# weight |w| <= ~4 and |x/rms| <= ~4: 2e-6; the bound 1e-6 rel + 1e-6 abs covers it.
RMS_NORM_TOL = 1e-6

# Native GEMM (q8-quantized activations, integer dots) against dequantized-tile GEMM (float32
# activations): q8 rounds each x_i within amax/254 of its block (uniform, std amax/(254·sqrt 3)),
# so y = w·x moves by about |w|·amax/440, against |y| ~ |w|·rms(x) with amax/rms ≈ 3-4 for
# Gaussian blocks: ~0.9% of a typical |y|, ~0.3% of the largest. 2e-2 of the largest output
# leaves a 6x margin.
Q8_ACTIVATION_REL = 2e-2

# Quantized packs against transformers on the dequantized GGUF weights (the same weights in
# float32): only activation rounding differs. The exact layout rounds every matmul input to q8
# (amax/254 per block of 32 or 256, as llama.cpp), int4pack to bfloat16 (epsbf16/2 ≈ 2e-3
# relative). Per linear layer that is ~2e-3 relative; through ~3 rounded inputs per layer,
# <= 4 layers and the LM head, with logits |z| <= ~8: ~8 · 2e-3 · sqrt(3·4+1) ≈ 0.06 of logit
# typical. The test bounds the 95th percentile of the per-position max over the vocabulary by
# llama.cpp's own deviation from the same reference on the same positions (it rounds to q8 too),
# times DEQUANT_SPREAD_FACTOR, and never below DEQUANT_FLOOR (the estimate above, doubled for a
# max over a 1024-entry vocabulary). Measured on AMD EPYC, 2026-12-01: exact layout 0.069-0.122
# against llama.cpp's 0.061-0.118 on the same positions (the same q8 arithmetic: within 1.13x of
# it), int4pack 0.032-0.098; the factor 2 covers two engines whose roundings are independent.
DEQUANT_SPREAD_FACTOR = 2.0
DEQUANT_FLOOR = 0.12

# Sampling tests: total variation between N seeded draws and the exact distribution over M
# outcomes. E[TV] = sum_i E|p^_i - p_i| / 2 <= sqrt(M / (2·pi·N)) (Cauchy-Schwarz over cells):
# M = 25, N = 6000 gives <= 0.026, and TV concentrates (McDiarmid: P[TV > E + t] <= exp(-2N t^2),
# t = 0.024 -> 1e-3). A verifier that accepted every draft scores > 0.3 on the same draws.
SAMPLING_TV = 0.05
