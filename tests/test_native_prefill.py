"""The native kernels' prefill path (more than one token: kquant_gemm.c's gemm_rows, weight rows
in cache-sized panels against four tokens at a time, and moe_ffn's blocked expert loop) gives
every element the bits of the one-token path (decode's), for every type, token count and row
count that does not fill a tile, at every thread count, and in the portable build; and it is
ggml's mul_mat where ggml itself uses its one-row kernel. Q4_K and Q6_K rows of six tokens or more
run the unpacked-panel tiles (gemm_rows_panel: two rows by four tokens; on AVX-512 VNNI two tokens a
register, on AVX2 one; an odd last row and the tokens beyond a multiple of four by the other
kernels), and the same checks hold them to the one-token bits, in this machine's build and in the
AVX2 build where that is another."""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from bounds import NATIVE_REORDER_ATOL_OF_MAX
from helpers import C_COMPILER, needs_avx2, needs_cc
from mawforge.kernels import native
from test_native import TYPES, _expert_set, _random_rows

pytestmark = needs_cc
TOKENS = (1, 2, 3, 5, 6, 11, 16, 27, 64, 130)   # 6, 11, 27, 130: 2, 3, 3 and 2 tokens past a four-token tile
# K = 2048 rows are 1.1-2.2 KiB: N = 130 spans two to five 64 KiB panels, and neither N nor a
# thread's share of it is a multiple of the two-row or four-token tiles
SHAPES = ((130, 2048), (61, 512), (7, 256))


def _one_token_rows(x: torch.Tensor, raw: torch.Tensor, qt: T, n: int, k: int) -> torch.Tensor:
    """Each row of x alone: the decode path (one token, weight rows in pairs)."""
    return torch.cat([native.gemm(x[i:i + 1], raw, qt, n, k) for i in range(x.shape[0])])


def _check_gemm(qt: T, shapes=SHAPES, thread_counts=(1, 2)) -> None:
    try:
        for n, k in shapes:
            raw = _random_rows(qt, n, k, seed=n + k)
            x = torch.randn(max(TOKENS), k, generator=torch.Generator().manual_seed(k)) * 3
            single = _one_token_rows(x, raw, qt, n, k)
            assert single.abs().sum() > 0
            for threads in thread_counts:
                native.set_thread_limit(threads)
                for m in TOKENS:
                    assert torch.equal(native.gemm(x[:m], raw, qt, n, k), single[:m]), (threads, n, k, m)
    finally:
        native.set_thread_limit(None)


@pytest.mark.parametrize("qt", TYPES)
def test_prefill_gemm_is_the_one_token_path_bit_for_bit(qt):
    _check_gemm(qt)


@pytest.mark.parametrize("qt", TYPES)
def test_prefill_gemm_is_ggml_mul_mat(qt):
    """The oracle, as test_native's: ggml's CPU mul_mat on the same bytes, at token counts that
    fill no tile and rows (130, K = 2048) that span several panels. Measured: the same bits at
    every M for Q8_0 and Q4_0, and up to M = 5 for Q4_K and Q6_K; from M = 16 ggml runs the
    K-quants through another kernel, and Q5_K's per-block float terms it sums in another order
    at every M: there within float32 summation order."""
    from mawforge.fixtures.ggml_ref import ggml_matmul
    raw = _random_rows(qt, 130, 2048, seed=3)
    for m in (2, 5, 16, 130):
        x = torch.randn(m, 2048, generator=torch.Generator().manual_seed(m))
        ref = ggml_matmul(raw.numpy(), int(qt), 130, 2048, x.numpy())
        got = native.gemm(x, raw, qt, 130, 2048).numpy()
        if qt in (T.Q8_0, T.Q4_0) or (m <= 5 and qt != T.Q5_K):
            np.testing.assert_array_equal(got, ref)
        else:
            np.testing.assert_allclose(got, ref, rtol=0, atol=NATIVE_REORDER_ATOL_OF_MAX * np.abs(ref).max())


@pytest.mark.parametrize("types", [(T.Q4_K, T.Q4_K, T.Q6_K), (T.Q5_K, T.Q5_K, T.Q4_K),
                                   (T.Q8_0, T.Q8_0, T.Q4_0), (T.Q4_K, T.Q8_0, T.Q6_K)])
def test_prefill_moe_ffn_is_the_one_token_path_bit_for_bit(types):
    """moe_ffn over M tokens against the same call one token at a time (decode's path), each
    token's output accumulated onto the same start; 130 tokens put more than the 64-pair chunk
    on an expert; threads 1 and 2 (the gate/up blocks are taken dynamically)."""
    _check_moe(types)


def _check_moe(types, tokens=TOKENS, thread_counts=(1, 2)) -> None:
    rng = np.random.default_rng(8)
    c, f, e = 512, 256, 5                         # F = 256: four 64-row blocks of gate and up rows
    experts = _expert_set(rng, f, c, types, e)
    batch = native.ExpertBatch(types, f, c)
    for g, u, d in experts:
        batch.add(g.data_ptr(), u.data_ptr(), d.data_ptr())
    x = torch.randn(max(tokens), c, generator=torch.Generator().manual_seed(1))
    wts = rng.random((e, x.shape[0])).astype(np.float32)
    wts[rng.random(wts.shape) < 0.4] = 0.0
    wts[3] = 0.0                                  # an expert no token uses
    start = torch.randn(x.shape[0], c, generator=torch.Generator().manual_seed(2))
    want = start.clone()
    for t in range(x.shape[0]):
        native.moe_ffn(x[t:t + 1], batch, wts[:, t:t + 1], want[t:t + 1])
    try:
        for threads in thread_counts:
            native.set_thread_limit(threads)
            for m in tokens:
                out = start[:m].clone()
                native.moe_ffn(x[:m], batch, wts[:, :m], out)
                assert torch.equal(out, want[:m]), (threads, m)
    finally:
        native.set_thread_limit(None)


@needs_avx2
@pytest.mark.parametrize("march", ["x86-64", "x86-64-v3"])
def test_other_builds_block_prefill_to_the_same_bits(tmp_path, march):
    """The scalar build (no AVX2) runs the same blocked loops with its one-row kernels, and the
    AVX2 build (x86-64-v3: on an AVX-512 CPU the code this library does not run) its own panel
    tiles: each element is again its one-token value, for every type."""
    simd = march != "x86-64"
    code = ("import sys, torch; sys.path.insert(0, 'tests'); from mawforge.kernels import native;"
            f"import test_native_prefill as t; assert native.simd() == {simd} and not native.library().vnni_path();"
            "[t._check_gemm(qt, ((61, 512), (7, 256)), (2,)) for qt in t.TYPES];"
            "from gguf import GGMLQuantizationType as T;"
            "t._check_moe((T.Q4_K, T.Q4_K, T.Q6_K), (2, 5, 16), (2,)); print('BUILD OK')")
    env = dict(os.environ, MAWFORGE_NATIVE_MARCH=march, MAWFORGE_CACHE=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0 and "BUILD OK" in r.stdout, r.stderr[-3000:]
    assert native.simd()


@needs_avx2
def test_the_avx512_vnni_kernels_compute_the_avx2_lanes(tmp_path):
    """The AVX-512 VNNI four-token kernels compiled here twice more: with their six 512-bit
    operations emulated by definition on AVX2 (tests/vnni_emu.h), and with VNNI off (the AVX2
    kernels). Every prefill result of the emulation is the AVX2 build's, bit for bit, and so is
    the loaded library's: on a VNNI CPU (AMD Zen 4, Intel Xeon) that is the CPU's own vpdpwssd
    against the AVX2 lanes; elsewhere the AVX2 build against itself."""
    import ctypes
    here = os.path.dirname(os.path.abspath(__file__))
    srcs = [str(s) for s in native.SOURCES]
    libs = {}
    for name, extra in (("emu", [f'-DMAWFORGE_VNNI_EMU="{here}/vnni_emu.h"']), ("avx2", ["-mno-avx512vnni"])):
        out = tmp_path / f"{name}.so"
        r = subprocess.run([C_COMPILER, *native.BASE_FLAGS, "-march=native", *extra, *srcs, "-o", str(out), "-lm"],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        libs[name] = ctypes.CDLL(str(out))
        libs[name].qgemm.argtypes = dict(native._SIGNATURES)["qgemm"]
    assert libs["emu"].vnni_path() == 1 and libs["avx2"].vnni_path() == 0
    for qt in (T.Q4_K, T.Q5_K, T.Q6_K):
        raw = _random_rows(qt, 61, 512, seed=2)
        for m in TOKENS:
            x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m)) * 3
            ys = {}
            for name, lib in libs.items():
                ys[name] = torch.empty(m, 61)
                assert lib.qgemm(int(qt), x.data_ptr(), m, 512, raw.data_ptr(), 61, ys[name].data_ptr()) == 0
            assert ys["avx2"].abs().sum() > 0
            assert torch.equal(ys["emu"], ys["avx2"]), (qt, m)
            assert torch.equal(native.gemm(x, raw, qt, 61, 512), ys["avx2"]), (qt, m, native.library().vnni_path())
