"""The native kernels on every GGUF type beyond the first five (kernels/native/quant_types.h):
exact integer block products on x quantized to llama.cpp's vec_dot type, the same bits for a token
alone or in a batch, the portable build's integers, ggml's own mul_mat on the same bytes, and the
fused expert call and dense F16 / BF16 weights taking them."""
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf import quants as gq

from bounds import NATIVE_REORDER_ATOL_OF_MAX, NATIVE_REORDER_RTOL, Q8_ACTIVATION_REL
from helpers import needs_avx2, needs_cc, scalar_build_gemms
from mawforge.codecs import quants
from mawforge.kernels import cpu, native

pytestmark = needs_cc
ROOT = Path(__file__).resolve().parents[1]
FIRST_FIVE = (T.Q4_0, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K)
TYPES = [t for t in native.TYPES if t not in FIRST_FIVE]
# byte offsets of each block's float16 scales: random bytes everywhere else (every bit pattern of
# the codes, grid indices and sign bits), sane scales there
F16_SCALES = {T.Q8_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.IQ4_NL: (0,), T.Q2_K: (80, 82),
              T.Q3_K: (108,), T.IQ4_XS: (0,), T.IQ2_XXS: (0,), T.IQ2_XS: (0,), T.IQ2_S: (0,), T.IQ3_XXS: (0,),
              T.IQ3_S: (0,), T.IQ1_S: (0,)}


def random_rows(qt: T, n: int, k: int, seed: int) -> torch.Tensor:
    """uint8 [n, row bytes] of qt: random codes, scales of ~0.01 (F16 / BF16: normal weights)"""
    rng = np.random.default_rng(seed)
    if qt in (T.F16, T.BF16):
        w = rng.standard_normal((n, k)).astype(np.float32)
        return torch.from_numpy(np.ascontiguousarray(gq.quantize(w, qt)).view(np.uint8).reshape(n, -1).copy())
    el, by = GGML_QUANT_SIZES[qt]
    b = rng.integers(0, 256, (n * k // el, by), dtype=np.uint8)
    scale = lambda: (rng.uniform(0.5, 1.0, len(b)) * 0.01).astype(np.float16)
    for off in F16_SCALES.get(qt, ()):
        b[:, off:off + 2] = scale().view(np.uint8).reshape(-1, 2)
    if qt == T.MXFP4:                                  # E8M0 exponents 2^-10 .. 2^-3
        b[:, 0] = rng.integers(118, 126, len(b))
    if qt == T.IQ1_M:                                  # its f16 scale: the top nibbles of four u16
        d, sc = scale().view(np.uint16), b[:, 48:56].copy().view(np.uint16)
        for i in range(4):
            sc[:, i] = (sc[:, i] & 0x0FFF) | (((d >> (4 * i)) & 0xF) << 12)
        b[:, 48:56] = sc.view(np.uint8)
    return torch.from_numpy(b.reshape(n, -1))


def dequantized(raw: torch.Tensor, qt: T, n: int, k: int) -> torch.Tensor:
    return torch.from_numpy(gq.dequantize(raw.numpy(), qt).reshape(n, k)).double()


def exact_product(x: torch.Tensor, raw: torch.Tensor, qt: T, n: int, k: int) -> torch.Tensor:
    """x . W^T in float64 on x as the kernel rounds it: q8 blocks (d * q), x rounded to f16 / bf16;
    for Q4_1 / Q5_1 each block's min meets s (f16(d * sum q), llama.cpp's q8_1) where the exact
    product has d * sum q."""
    w = dequantized(raw, qt, n, k)
    out = []
    for r in x:
        q, d, bs = native.quantize_acts(r, qt)
        if qt in native.FLOAT_TYPES:
            out.append(q.double() @ w.T)
            continue
        blk = native.ACT_BLOCK[qt]
        xs = (q.double().view(-1, blk) * d.double()[:, None])
        y = xs.reshape(-1) @ w.T
        if qt in native.Q8_1_TYPES:
            by = GGML_QUANT_SIZES[qt][1]
            m = torch.from_numpy(raw.numpy().reshape(-1, by)[:, 2:4].copy().view(np.float16).astype(np.float64))
            s = bs.view(torch.float32).double()
            y = y + (m.view(n, -1) * (s - xs.sum(1))[None, :]).sum(1)
        out.append(y)
    return torch.stack(out)


def test_the_kernels_take_every_type_llama_cpps_quantizer_writes_into_moe_models():
    want = {"Q2_K", "Q3_K", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS", "IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS",
            "IQ2_S", "IQ1_S", "IQ1_M", "MXFP4", "BF16", "F16"}
    assert want <= {t.name for t in TYPES}
    assert all(native.available(t) for t in TYPES)
    assert not native.available(T.TQ2_0) and not native.available(T.F32)


def test_iq_tables_are_the_gguf_packages_codebooks():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_iq_tables.py"), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 0, "iq_tables.h differs from scripts/gen_iq_tables.py's output: regenerate it"


@pytest.mark.parametrize("qt", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 6])
def test_gemm_is_exact_on_the_quantized_activations(qt, m):
    """Integer block products are exact: against x rounded as the kernel rounds it times the W gguf
    dequantizes (float64), only float32 summation order differs; and that rounding costs < 2%."""
    n, k = 48, 512
    raw = random_rows(qt, n, k, seed=int(qt) + m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    got = native.gemm(x, raw, qt, n, k).double()
    want = exact_product(x, raw, qt, n, k)
    assert (got - want).abs().max().item() < 2e-6 * want.abs().max().item()
    full = x.double() @ dequantized(raw, qt, n, k).T
    assert ((got - full).norm() / full.norm()).item() < Q8_ACTIVATION_REL


@pytest.mark.parametrize("qt", TYPES, ids=lambda t: t.name)
def test_a_token_in_a_batch_has_its_bits_alone(qt):
    """The four-token kernels (a block decoded once for four tokens) and the padded groups give each
    token exactly the one-token kernel's result."""
    raw = random_rows(qt, 40, 768, seed=3)
    x = torch.randn(11, 768, generator=torch.Generator().manual_seed(6))
    batched = native.gemm(x, raw, qt, 40, 768)
    single = torch.cat([native.gemm(x[i:i + 1], raw, qt, 40, 768) for i in range(11)])
    assert torch.equal(batched, single)


@pytest.mark.parametrize("qt", TYPES, ids=lambda t: t.name)
def test_native_gemm_is_ggml_mul_mat(qt):
    """ggml's own CPU mul_mat (the libggml llama-cpp-python ships) on the same bytes and x: the same
    activation rounding and integer products, float32 summation order apart."""
    from mawforge.fixtures.ggml_ref import ggml_matmul
    raw = random_rows(qt, 64, 512, seed=11)
    for m in (1, 4, 19):
        x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m))
        ref = ggml_matmul(raw.numpy(), int(qt), 64, 512, x.numpy())
        got = native.gemm(x, raw, qt, 64, 512).numpy()
        np.testing.assert_allclose(got, ref, rtol=0, atol=NATIVE_REORDER_ATOL_OF_MAX * np.abs(ref).max())


@needs_avx2
def test_scalar_build_computes_the_same_integers(tmp_path):
    """The portable C path (no AVX2) runs the same integer arithmetic: identical up to float order."""
    raw = {qt: random_rows(qt, 32, 512, seed=5) for qt in TYPES}
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(9))
    scalars = scalar_build_gemms(tmp_path, raw, x, 32, 512)
    for qt in TYPES:
        scalar = scalars[qt]
        simd = native.gemm(x, raw[qt], qt, 32, 512)
        torch.testing.assert_close(scalar, simd, rtol=NATIVE_REORDER_RTOL,
                                   atol=NATIVE_REORDER_RTOL * simd.abs().max().item())


def _weight(qt: T, raw: torch.Tensor, n: int, k: int) -> quants.PackedWeight:
    codec = quants.choose_codec(qt)
    buf = raw.reshape(-1).clone()
    return codec.view(buf, [0], codec.parts(qt, (n, k)), qt, (n, k))


@pytest.mark.parametrize("types", [(T.IQ2_XXS, T.IQ2_XXS, T.Q3_K), (T.MXFP4, T.MXFP4, T.MXFP4),
                                   (T.Q4_1, T.Q5_0, T.Q8_0), (T.IQ1_M, T.IQ3_S, T.IQ4_XS), (T.F16, T.BF16, T.F16)],
                         ids=lambda ts: "-".join(t.name for t in ts))
@pytest.mark.parametrize("m", [1, 7])
def test_moe_ffn_is_its_gemms(types, m):
    """A layer's experts in one call (gate and up of different activation kinds included; F16 and
    BF16 as the dense codecs store them) equal SwiGLU of the one-matrix products, expert by expert."""
    rng = np.random.default_rng(m)
    c, f, e = 512, 256, 3
    experts = [[random_rows(types[0], f, c, 10 * i), random_rows(types[1], f, c, 10 * i + 1),
                random_rows(types[2], c, f, 10 * i + 2)] for i in range(e)]
    ws = [[_weight(t, r, *shape) for t, r, shape in zip(types, ex, ((f, c), (f, c), (c, f)))] for ex in experts]
    assert cpu.native_swiglu_types({"gate": ws[0][0], "up": ws[0][1], "down": ws[0][2]}, m) == types
    x = torch.randn(m, c, generator=torch.Generator().manual_seed(3))
    wts = rng.random((e, m)).astype(np.float32)
    if m > 1:
        wts[rng.random((e, m)) < 0.4] = 0.0
    batch = native.ExpertBatch(types, f, c)
    for g, u, d in ws:
        batch.add(*(cpu.native_rows(w).data_ptr() for w in (g, u, d)))
    out = torch.zeros(m, c)
    native.moe_ffn(x, batch, wts, out)
    want = torch.zeros(m, c)
    for i, (g, u, d) in enumerate(ws):
        h = torch.nn.functional.silu(cpu.linear(x, g)) * cpu.linear(x, u)
        want += torch.from_numpy(wts[i])[:, None] * cpu.linear(h, d)
    torch.testing.assert_close(out, want, rtol=NATIVE_REORDER_RTOL, atol=NATIVE_REORDER_RTOL * want.abs().max().item())


@pytest.mark.parametrize("qt", [T.F16, T.BF16])
def test_dense_half_weights_run_on_the_native_kernels(qt, monkeypatch):
    """F16 / BF16 weights (the dense codecs) go through the native kernels on x rounded to their
    type, as llama.cpp's vec_dot does, and agree with the float path."""
    raw = random_rows(qt, 64, 256, seed=2)
    w = _weight(qt, raw, 64, 256)
    assert w.codec == qt.name.lower()
    calls = []
    real = native.gemm
    monkeypatch.setattr(native, "gemm", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    x = torch.randn(3, 256)
    y = cpu.linear(x, w)
    assert calls == [3]
    assert torch.equal(y, native.gemm(x, raw, qt, 64, 256))
    ref = x.double() @ quants.dequantize(w).double().T
    assert ((y.double() - ref).norm() / ref.norm()).item() < Q8_ACTIVATION_REL
