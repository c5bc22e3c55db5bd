"""The native K-quant kernels against the bit-exact torch dequantization, and their dispatch."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants as gq

from mawforge.formats import quants
from mawforge.kernels import cpu, dequant, native


def _random_rows(qt: T, n: int, k: int) -> torch.Tensor:
    data = np.random.default_rng(1).standard_normal((n, k)).astype(np.float32)
    from mawforge.fixtures.kquants import quantize
    return torch.from_numpy(np.ascontiguousarray(quantize(data, qt)).reshape(n, -1))


def test_native_library_builds_here():
    # the machine has a C compiler (gcc is part of the image); the kernels must be in use
    assert native.available(T.Q6_K) and native.available(T.Q5_K)


@pytest.mark.parametrize("qt", [T.Q6_K, T.Q5_K])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_native_gemm_matches_dequantized_reference(qt, m):
    raw = _random_rows(qt, 96, 512)
    w = dequant.dequantize_rows(raw, qt, 512)
    ref = torch.from_numpy(gq.dequantize(raw.numpy(), qt).reshape(96, 512))
    torch.testing.assert_close(w, ref, rtol=0, atol=0)
    x = torch.randn(m, 512)
    got = native.gemm(x, raw, qt, 96, 512).double()
    want = x.double() @ ref.double().T
    if qt == T.Q6_K and native.q6k_quantizes_activations():
        # integer path: x rounded to int8 per 256 (as llama.cpp's q8_K); measured ~0.7% relative
        assert ((got - want).norm() / want.norm()).item() < 2e-2
        assert (got - want).abs().max().item() < 5e-2 * want.abs().max().item()
    else:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_linear_dispatches_small_batches_to_native_and_large_to_tiles(monkeypatch):
    raw = _random_rows(T.Q6_K, 64, 256)
    codec = quants.get_codec("ggml")
    spec = codec.parts(T.Q6_K, (64, 256))
    pw = codec.view(raw.reshape(-1), [0], spec, T.Q6_K, (64, 256))
    calls = []
    real = native.gemm
    monkeypatch.setattr(native, "gemm", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    x = torch.randn(40, 256)
    small, big = cpu.linear(x[:2], pw), cpu.linear(x, pw)
    assert calls == [2]
    torch.testing.assert_close(small, big[:2], rtol=2e-2, atol=2e-2 * big.abs().max().item())
