"""The native kernels on GGUF blocks: exact integer arithmetic on q8-quantized activations (as
llama.cpp's CPU backend), the activation quantizers, the fused expert call, and the dispatch."""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants as gq

from helpers import C_COMPILER as C_COMPILER_PATH
from helpers import needs_avx2, needs_cc, scalar_build_gemms
from mawforge.codecs import quants
from mawforge.kernels import cpu, native, q8_0
from bounds import (ACT_SCALE_REL, NATIVE_REORDER_ATOL_OF_MAX, NATIVE_REORDER_RTOL, Q8_ACTIVATION_REL,
                    RMS_NORM_TOL)

pytestmark = needs_cc
TYPES = [T.Q4_0, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]


def _random_rows(qt: T, n: int, k: int, seed: int = 1) -> torch.Tensor:
    data = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    from mawforge.fixtures.kquants import quantize
    try:
        q = quantize(data, qt)
    except (KeyError, ValueError, NotImplementedError):
        q = gq.quantize(data, qt)          # Q4_0 / Q8_0: gguf's own quantizers
    return torch.from_numpy(np.ascontiguousarray(q).reshape(n, -1))


def _dequantized(raw: torch.Tensor, qt: T, n: int, k: int) -> torch.Tensor:
    return torch.from_numpy(gq.dequantize(raw.numpy(), qt).reshape(n, k)).double()


def _x_as_kernel_sees_it(x: torch.Tensor, qt: T) -> torch.Tensor:
    rows = []
    for r in x:
        q, d, _ = native.quantize_acts(r, qt)
        rows.append((q.double().view(-1, native.ACT_BLOCK[qt]) * d.double()[:, None]).reshape(-1))
    return torch.stack(rows)


def test_native_library_builds_here():
    # the machine has a C compiler (gcc is part of the image); the kernels must be in use
    assert all(native.available(t) for t in TYPES) and not native.available(T.TQ2_0)


@pytest.mark.parametrize("qt", TYPES)
@pytest.mark.parametrize("m", [1, 3, 8, 40])
def test_gemm_is_exact_on_the_quantized_activations(qt, m):
    """The integer block dots are exact: against x rounded as the kernel rounds it (q8 per block,
    the llama.cpp way) times the dequantized W, only float32 summation order differs."""
    raw = _random_rows(qt, 96, 512)
    w = _dequantized(raw, qt, 96, 512)
    x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m))
    got = native.gemm(x, raw, qt, 96, 512).double()
    want = _x_as_kernel_sees_it(x, qt) @ w.T
    assert (got - want).abs().max().item() < 2e-6 * want.abs().max().item()
    # and the activation rounding costs under 1% against the float product
    full = x.double() @ w.T
    assert ((got - full).norm() / full.norm()).item() < 1e-2


def _q8k_model(v: np.ndarray) -> tuple[np.ndarray, float]:
    """llama.cpp's quantize_row_q8_K for one block: iscale = -127 / (the element of largest |x|)."""
    a = np.abs(v).max()
    if a == 0:
        return np.zeros_like(v, dtype=np.int8), 0.0
    iscale = np.float32(-127.0) / np.float32(v[np.argmax(np.abs(v))])
    return np.minimum(127, np.rint(iscale * v)).astype(np.int8), float(np.float32(1.0) / iscale)


def _q80_model(v: np.ndarray) -> tuple[np.ndarray, float]:
    """llama.cpp's AVX2 quantize_row_q8_0: q = round(x * 127 / max|x|), d = max|x| / 127 as f16."""
    a = np.float32(np.abs(v).max())
    iscale = np.float32(127.0) / a if a else np.float32(0)
    return np.rint(v * iscale).astype(np.int8), float(np.float16(a / np.float32(127.0)))


@pytest.mark.parametrize("qt,model", [(T.Q4_K, _q8k_model), (T.Q8_0, _q80_model)])
def test_activation_quantizers_match_llama_cpp(qt, model):
    rng = np.random.default_rng(7)
    blk = native.ACT_BLOCK[qt]
    for trial in range(30):
        x = (rng.standard_normal(1024) * 10.0 ** rng.uniform(-4, 4)).astype(np.float32)
        if trial == 0:
            x[:blk] = 0.0                       # an all-zero block
        q, d, bs = native.quantize_acts(torch.from_numpy(x), qt)
        for b, v in enumerate(x.reshape(-1, blk)):
            wq, wd = model(v)
            np.testing.assert_array_equal(q.view(-1, blk)[b].numpy(), wq)
            assert d[b].item() == pytest.approx(wd, rel=ACT_SCALE_REL, abs=0)
        if blk == 256:
            np.testing.assert_array_equal(bs.numpy(), q.view(-1, 16).sum(1).numpy())


def _expert_set(rng, f, c, types, n):
    from mawforge.fixtures.kquants import quantize
    mk = lambda qt, rows, cols: torch.from_numpy(np.ascontiguousarray(
        quantize((rng.standard_normal((rows, cols)) * 0.1).astype(np.float32), qt)).reshape(rows, -1))
    return [(mk(types[0], f, c), mk(types[1], f, c), mk(types[2], c, f)) for _ in range(n)]


@pytest.mark.parametrize("types", [(T.Q4_K, T.Q4_K, T.Q6_K), (T.Q5_K, T.Q5_K, T.Q4_K)])
@pytest.mark.parametrize("m", [1, 5])
def test_moe_ffn_equals_the_experts_one_by_one(types, m):
    rng = np.random.default_rng(m)
    c, f, e = 512, 256, 4
    experts = _expert_set(rng, f, c, types, e)
    x = torch.randn(m, c, generator=torch.Generator().manual_seed(3))
    wts = rng.random((e, m)).astype(np.float32)
    if m > 1:
        wts[rng.random((e, m)) < 0.5] = 0.0     # tokens use different experts
    batch = native.ExpertBatch(types, f, c)
    for g, u, d in experts:
        batch.add(g.data_ptr(), u.data_ptr(), d.data_ptr())
    out = torch.full((m, c), 0.25)              # accumulates into out
    native.moe_ffn(x, batch, wts, out)
    want = torch.full((m, c), 0.25)
    for i, (g, u, d) in enumerate(experts):
        for t in range(m):
            if wts[i, t]:
                h = (torch.nn.functional.silu(native.gemm(x[t:t + 1], g, types[0], f, c))
                     * native.gemm(x[t:t + 1], u, types[1], f, c))
                want[t] += wts[i, t] * native.gemm(h, d, types[2], c, f)[0]
    torch.testing.assert_close(out, want, rtol=NATIVE_REORDER_RTOL, atol=NATIVE_REORDER_RTOL * want.abs().max().item())


def test_moe_ffn_reads_gate_and_up_as_halves_of_a_fused_gate_up():
    rng = np.random.default_rng(2)
    c, f = 512, 256
    (g, u, d), = _expert_set(rng, f, c, (T.Q4_K, T.Q4_K, T.Q6_K), 1)
    gate_up = torch.cat((g, u))
    x = torch.randn(2, c)
    wts = np.ones((1, 2), np.float32)
    split, fused = (native.ExpertBatch((T.Q4_K, T.Q4_K, T.Q6_K), f, c),
                    native.ExpertBatch((T.Q4_K, T.Q4_K, T.Q6_K), f, c))
    split.add(g.data_ptr(), u.data_ptr(), d.data_ptr())
    fused.add(gate_up.data_ptr(), gate_up[f:].data_ptr(), d.data_ptr())
    a, b = torch.zeros(2, c), torch.zeros(2, c)
    native.moe_ffn(x, split, wts, a)
    native.moe_ffn(x, fused, wts, b)
    assert torch.equal(a, b) and a.abs().sum() > 0


@needs_avx2
def test_scalar_build_computes_the_same_integers(tmp_path):
    """The portable C path (no AVX2) runs the same integer arithmetic: identical up to float order."""
    raw = {qt: _random_rows(qt, 64, 512, seed=5) for qt in TYPES}
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(9))
    scalars = scalar_build_gemms(tmp_path, raw, x, 64, 512)
    assert native.simd()
    for qt in TYPES:
        scalar = scalars[qt]
        simd = native.gemm(x, raw[qt], qt, 64, 512)
        torch.testing.assert_close(scalar, simd, rtol=NATIVE_REORDER_RTOL,
                                   atol=NATIVE_REORDER_RTOL * simd.abs().max().item())


@needs_avx2
@pytest.mark.parametrize("march", ["x86-64", "x86-64-v3"])
def test_every_build_attends_and_routes_to_the_same_bits(tmp_path, march):
    """attend_one and route_topk sum in 16 lanes of one fixed order (GCC vector types, no FMA
    contraction), and convert float16 by IEEE rules either way (F16C or libgcc): the portable
    build gives the SIMD build's bits for every KV dtype (q8_0 included), and so does any thread count.
    On a float16 cache a build with FMA attends with fused multiply-adds (exact float16 products):
    the AVX2 + FMA build (x86-64-v3, two 8-lane halves) and this machine's build (AVX-512 where it
    has it) give the portable build's bits, which has a multiply and an add."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 8, 64, generator=g)
    cache = {dt: (torch.randn(2, 40, 64, generator=g).to(getattr(torch, dt)),
                  torch.randn(2, 40, 64, generator=g).to(getattr(torch, dt)))
             for dt in ("float32", "float16", "bfloat16")}
    cache["q8_0"] = tuple(q8_0.quantize(torch.randn(2, 40, 64, generator=g)) for _ in range(2))
    qs = torch.randn(7, 8, 64, generator=g)
    x, w = torch.randn(1, 96, generator=g), torch.randn(24, 96, generator=g)
    # float16, three heads a group of 72 (no multiple of 16 or 64): the kernels' one-row and tail loops;
    # and q times 60 (scores hundreds apart: exp's underflow to 0 in the softmax)
    odd = {"q": torch.randn(1, 6, 72, generator=g), "qs": torch.randn(7, 6, 72, generator=g),
           "k": torch.randn(2, 40, 72, generator=g).half(), "v": torch.randn(2, 40, 72, generator=g).half()}
    torch.save({"q": q, "qs": qs, "cache": cache, "x": x, "w": w, "odd": odd}, tmp_path / "in.pt")
    code = ("import sys, torch; from mawforge.kernels import native;"
            f"assert native.simd() == {march != 'x86-64'};"
            "d = torch.load(sys.argv[1] + '/in.pt');"
            "out = {dt: native.attend_one(d['q'], k[:, :33], v[:, :33], 0.125) for dt, (k, v) in d['cache'].items()};"
            "out.update({dt + '-rows': native.attend_rows(d['qs'], k[:, :37], v[:, :37], 0.125)"
            " for dt, (k, v) in d['cache'].items()});"
            "out['route'] = native.route_topk(d['x'], d['w'], 5, True);"
            "o = d['odd']; out['odd'] = native.attend_one(o['q'], o['k'][:, :33], o['v'][:, :33], 0.125);"
            "k, v = d['cache']['float32']; out['big'] = native.attend_rows(d['qs'] * 60, k[:, :37], v[:, :37], 0.125);"
            "out['odd-rows'] = native.attend_rows(o['qs'], o['k'][:, :37], o['v'][:, :37], 0.125);"
            "torch.save(out, sys.argv[1] + '/out.pt')")
    env = dict(os.environ, MAWFORGE_NATIVE_MARCH=march, MAWFORGE_CACHE=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert native.simd()
    portable = torch.load(tmp_path / "out.pt")
    try:
        for threads in (1, 2):
            native.set_thread_limit(threads)
            for dt, (k, v) in cache.items():
                got = native.attend_one(q, k[:, :33], v[:, :33], 0.125)
                assert torch.equal(got, portable[dt]) and got.abs().sum() > 0, dt
                rows = native.attend_rows(qs, k[:, :37], v[:, :37], 0.125)
                assert torch.equal(rows, portable[dt + "-rows"]) and rows.abs().sum() > 0, dt
            idx, wt = native.route_topk(x, w, 5, True)
            assert torch.equal(idx, portable["route"][0]) and torch.equal(wt, portable["route"][1])
            assert torch.equal(native.attend_one(odd["q"], odd["k"][:, :33], odd["v"][:, :33], 0.125), portable["odd"])
            assert torch.equal(native.attend_rows(odd["qs"], odd["k"][:, :37], odd["v"][:, :37], 0.125),
                               portable["odd-rows"])
            k, v = cache["float32"]
            assert torch.equal(native.attend_rows(qs * 60, k[:, :37], v[:, :37], 0.125), portable["big"])
    finally:
        native.set_thread_limit(None)
    # and the softmax top-k is the one torch computes, to float32 rounding
    ref_w, ref_i = torch.topk(torch.softmax(x @ w.T, -1), 5)
    assert torch.equal(idx, ref_i)
    torch.testing.assert_close(wt, ref_w / ref_w.sum(-1, keepdim=True), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("C", [96, 100])
def test_routing_rows_gives_each_row_its_one_token_bits(C):
    """route_topk over T rows (a prompt's router, route_topk_rows: four rows share each load of W)
    gives every row the idx and weights of that row routed alone (the decode step's call), at 1
    and 2 threads, for T not a multiple of the 4-row block and a width that is not a multiple of 16."""
    g = torch.Generator().manual_seed(C)
    x, w = torch.randn(11, C, generator=g), torch.randn(24, C, generator=g)
    alone = [native.route_topk(x[t:t + 1], w, 5, True) for t in range(11)]
    try:
        for threads in (1, 2):
            native.set_thread_limit(threads)
            idx, wt = native.route_topk(x, w, 5, True)
            assert idx.shape == (11, 5) and wt.shape == (11, 5)
            for t, (i1, w1) in enumerate(alone):
                assert torch.equal(idx[t:t + 1], i1) and torch.equal(wt[t:t + 1], w1), (threads, t)
    finally:
        native.set_thread_limit(None)
    ref_w, ref_i = torch.topk(torch.softmax(x @ w.T, -1), 5)
    assert torch.equal(idx, ref_i)
    torch.testing.assert_close(wt, ref_w / ref_w.sum(-1, keepdim=True), rtol=1e-5, atol=1e-6)


def _attention_reference(q, keys, vals, scale):
    """llama.cpp's CPU attention in float64: q and the probabilities rounded to the cache dtype,
    token t of T seeing the first S - T + t + 1 positions. q [T, H, D], keys/vals [G, S, D]."""
    T, H, D = q.shape
    G, S = keys.shape[:2]
    qr = q.to(keys.dtype).double().view(T, G, H // G, D)
    sc = torch.einsum("tgjd,gsd->tgjs", qr, keys.double()) * scale
    sc = sc.masked_fill(torch.arange(S)[None] > (S - T + torch.arange(T))[:, None, None, None], float("-inf"))
    p = torch.softmax(sc.float(), -1).to(vals.dtype).double()
    return torch.einsum("tgjs,gsd->tgjd", p, vals.double()).reshape(T, H * D)


def _rows_are_decode_steps(q, keys, vals, scale, tokens) -> torch.Tensor:
    """attend_rows at 1 and 2 threads: the same bits, and each of `tokens`' rows the bits attend_one
    (the decode step) gives at its position; returns the rows."""
    T, S = q.shape[0], keys.shape[1]
    try:
        outs = []
        for threads in (1, 2):
            native.set_thread_limit(threads)
            rows = native.attend_rows(q, keys, vals, scale)
            for t in tokens:
                one = native.attend_one(q[t:t + 1], keys[:, :S - T + t + 1], vals[:, :S - T + t + 1], scale)
                assert torch.equal(rows[t:t + 1], one), (threads, t)
            outs.append(rows)
        assert torch.equal(outs[0], outs[1])
    finally:
        native.set_thread_limit(None)
    return rows


@pytest.mark.parametrize("dt", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("H,G,D", [(8, 2, 64), (6, 3, 40), (12, 4, 128), (4, 4, 16)])
def test_prefill_attention_rows_are_the_decode_steps_bits(dt, H, G, D):
    """attend_rows (a prefill chunk's causal attention) gives every token the bits attend_one (the
    decode step's attention) gives at that token's position, whatever the thread count, for head
    dims that are and are not multiples of 16, odd heads per group, a chunk that is not a multiple
    of the 4-token block and a span that is not a multiple of the 64-row tile; and it is
    llama.cpp's arithmetic (rounded q and probabilities) to float32 accuracy."""
    g = torch.Generator().manual_seed(H * D)
    S, T = 150, 37
    keys = torch.randn(G, 160, D, generator=g).to(getattr(torch, dt))[:, :S]      # a view of a longer cache
    vals = torch.randn(G, 160, D, generator=g).to(getattr(torch, dt))[:, :S]
    q = torch.randn(T, H, D, generator=g) * 2
    rows = _rows_are_decode_steps(q, keys, vals, D ** -0.5, (0, 1, 5, 18, 36))
    ref = _attention_reference(q, keys, vals, D ** -0.5)
    assert rows.shape == (T, H * D)
    # a probability's float32 value may differ from torch's in its last bit (another exp), which
    # can round it to the neighbouring float16/bfloat16 value: one ulp of p times |v| at most
    ulp = {"float32": 0.0, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}[dt]
    torch.testing.assert_close(rows.double(), ref, rtol=1e-4, atol=1e-5 + 4 * ulp)


def test_q8_0_rows_are_the_bytes_ggml_writes():
    """A q8_0 row (kernels/q8_0.quantize) is the bytes ggml's CPU quantize_row_q8_0 writes (what
    llama.cpp's cache holds with --cache-type-k/v q8_0), ties to even, all-zero blocks and 127 x d
    included; decode_step.c's kv_put (the decode step's write) gives the bytes the torch path (a
    prompt's chunks) gives for the rotated key and value; dequantize is gguf-py's reading."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    from mawforge.fixtures.ggml_ref import ggml_quantize_q8_0
    g = torch.Generator().manual_seed(8)
    x = torch.randn(96, 128, generator=g) * torch.rand(96, 1, generator=g) * 5
    x[1] = 0                                              # amax 0: d 0, q 0
    x[2, :32] = torch.arange(32) - 12.7                   # x * 127 / amax lands on .5 (ties to even)
    x[3, 64:96] = 1e-30                                    # tiny d (a float16 subnormal or 0)
    # a rotated query row whose block 0 has x * (127 / amax) = -87.5 exactly when 127 / amax is one
    # division (torch's 127.0 / tensor is reciprocal() times 127: -87.49999, and -87 instead of -88)
    q = torch.randn(37, 32, 128, generator=torch.Generator().manual_seed(187)) * 2
    x[4] = q8_0.rot_k(q[36, 23].view(1, 128))[0]
    ref = ggml_quantize_q8_0(x.numpy())
    rows = q8_0.quantize(x)
    assert rows.dtype == torch.uint8 and rows.shape == (96, 136)
    assert np.array_equal(rows.numpy(), ref)
    lib = native.library()
    kc, vc = torch.zeros(2, 48, 136, dtype=torch.uint8), torch.zeros(2, 48, 136, dtype=torch.uint8)
    for pos in range(48):                                  # two heads a position, as a decode step writes them
        k, v = x[2 * pos:2 * pos + 2].contiguous(), x[(2 * pos + 7) % 96].repeat(2, 1).contiguous()
        lib.kv_put(k.data_ptr(), v.data_ptr(), kc.data_ptr(), vc.data_ptr(), native.KV_DTYPES[torch.uint8], 2, 128,
                   48 * 128, pos)
        assert torch.equal(kc[:, pos], q8_0.quantize(q8_0.rot_k(k)))
        assert torch.equal(vc[:, pos], q8_0.quantize(q8_0.rot_v(v)))
    back = dequantize(ref, GGMLQuantizationType.Q8_0)
    assert np.array_equal(q8_0.dequantize(rows).numpy(), back)
    blocks = x.numpy().reshape(96, 4, 32)      # within half a step plus d's float16 rounding (127 x 2^-11 d)
    step = np.abs(blocks).max(-1, keepdims=True) / 127
    assert (np.abs(back.reshape(96, 4, 32) - blocks) <= step * (0.5 + 127 * 2.0 ** -11) + 1e-30).all()


def _sylvester(n: int) -> np.ndarray:
    """llama.cpp's rotation matrix (llama-kv-cache.cpp ggml_gen_hadamard): Sylvester's H_n / sqrt(n)."""
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


@pytest.mark.parametrize("D", [64, 128, 192, 96])
def test_q8_0_rotation_is_llama_cpps_hadamard(D):
    """kernels/q8_0.rot_k / rot_v are llama.cpp's rotations of a quantized cache: keys and queries by
    H_nk in blocks (nk the largest power of two >= 64 dividing D), values and the output by H_64, none
    where D is no multiple of 64; each its own inverse."""
    x = torch.randn(5, D, generator=torch.Generator().manual_seed(D), dtype=torch.float32)
    nk = q8_0.rot_k_block(D)
    assert nk == {64: 64, 128: 128, 192: 64, 96: 0}[D]
    for got, n in ((q8_0.rot_k(x), nk), (q8_0.rot_v(x), 64 if D % 64 == 0 else 0)):
        want = x.double().numpy()
        if n:
            want = (want.reshape(5, D // n, n) @ _sylvester(n)).reshape(5, D)
        np.testing.assert_allclose(got.double().numpy(), want, rtol=0, atol=1e-6)
    if nk:
        torch.testing.assert_close(q8_0.rot_k(q8_0.rot_k(x)), x, rtol=0, atol=1e-6)


@pytest.mark.parametrize("H,G,D,S,T", [(32, 4, 128, 150, 37), (8, 2, 64, 70, 1), (32, 4, 128, 600, 64),
                                       (6, 3, 96, 80, 9)])
def test_q8_0_attention_is_ggml_flash_attention(H, G, D, S, T):
    """The oracle for a q8_0 cache, as llama.cpp's graph computes it: q rotated (where D % 64 == 0;
    by rot_k, which the test above holds to the Sylvester matrix: rotated apart, a last-bit difference
    in q flips its 8-bit rounding now and then), ggml's flash attention over the same q8_0 bytes (Q
    through q8_0 for the q8_0 x q8_0 dot, V dequantized, softmax in float32), the output rotated back
    by the Sylvester matrix; attend_rows gives that to float32 order, every token's row the bits
    attend_one gives at its position (1 and 2 threads), and the torch path (models/base.attend with a
    window past S) agrees. Without the rotation (KV_Q8_0_PLAIN) it is flash attention alone."""
    from mawforge.fixtures.ggml_ref import ggml_flash_attention_q8_0
    from mawforge.models import base
    g = torch.Generator().manual_seed(S + T)
    q = torch.randn(T, H, D, generator=g) * 2
    keys = q8_0.quantize(torch.randn(G, S + 9, D, generator=g))[:, :S]        # a view of a longer cache
    vals = q8_0.quantize(torch.randn(G, S + 9, D, generator=g))[:, :S]
    assert native.attend_takes(q, keys, vals)
    nv = 64 if D % 64 == 0 else 0
    fa = ggml_flash_attention_q8_0(q8_0.rot_k(q).numpy(), keys.contiguous().numpy(), vals.contiguous().numpy(),
                                   D ** -0.5).reshape(T, H, D).astype(np.float64)
    ref = torch.from_numpy((fa.reshape(T, H, D // nv, nv) @ _sylvester(nv)).reshape(T, H * D) if nv else fa)
    ref = ref.reshape(T, H * D).float()
    rows = _rows_are_decode_steps(q, keys, vals, D ** -0.5, sorted({0, T // 2, T - 1}))
    assert ref.shape == rows.shape == (T, H * D) and ref.abs().sum() > 0
    torch.testing.assert_close(rows, ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(base.attend(q, keys, vals, D ** -0.5, window=10_000), rows, rtol=1e-4, atol=1e-5)
    plain = native.attend_rows(q, keys, vals, D ** -0.5, rotated=False)
    ref_plain = ggml_flash_attention_q8_0(q.numpy(), keys.contiguous().numpy(), vals.contiguous().numpy(), D ** -0.5)
    torch.testing.assert_close(plain, torch.from_numpy(ref_plain), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(base.attend(q, keys, vals, D ** -0.5, window=10_000, rotated=False), plain,
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("H,G,D,S,T", [(32, 4, 128, 150, 37), (32, 4, 128, 600, 64), (8, 2, 64, 70, 1),
                                       (6, 3, 40, 90, 90)])
def test_prefill_attention_is_ggml_attention(H, G, D, S, T):
    """The oracle: the graph llama.cpp's CPU attention builds without flash attention (ggml's
    mul_mat K.Q, causal soft_max_ext, mul_mat V^T.P over its float16 cache layout, in a child
    process) gives what attend_rows gives, to float32 summation order and the float16 rounding
    of a probability (ggml's exp is another last bit: one float16 ulp of p times |v|), for a
    chunk, one decode token and a whole prompt, head dims that are and are not multiples of 16."""
    from mawforge.fixtures.ggml_ref import ggml_attention
    g = torch.Generator().manual_seed(S + T)
    q = torch.randn(T, H, D, generator=g) * 2
    keys, vals = torch.randn(G, S, D, generator=g).half(), torch.randn(G, S, D, generator=g).half()
    ref = torch.from_numpy(ggml_attention(q.numpy(), keys.numpy(), vals.numpy(), D ** -0.5))
    got = native.attend_rows(q, keys, vals, D ** -0.5)
    assert ref.shape == got.shape == (T, H * D) and ref.abs().sum() > 0
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5 + 4 * 2.0 ** -11)


def test_prefill_attention_is_what_attend_uses_and_agrees_with_the_torch_path():
    """models.base.attend takes the native rows for a chunk on the CPU; the torch path (kept for
    other devices and sliding windows) computes the same attention to float32 rounding."""
    from mawforge.models import base
    g = torch.Generator().manual_seed(11)
    keys = torch.randn(4, 90, 128, generator=g).half()
    vals = torch.randn(4, 90, 128, generator=g).half()
    q = torch.randn(20, 32, 128, generator=g)
    assert native.attend_takes(q, keys, vals)
    got = base.attend(q, keys, vals, 0.088)
    assert torch.equal(got, native.attend_rows(q, keys, vals, 0.088))
    torch_path = base.attend(q, keys, vals, 0.088, window=10_000)       # a window past S: plain causal, in torch
    # float16 probabilities: a last-bit difference of p in float32 may round to the next float16 value
    torch.testing.assert_close(got, torch_path, rtol=1e-4, atol=1e-5 + 4 * 2.0 ** -11)
    # what the native call does not take goes to torch: more queries than positions, mismatched dtypes
    assert not native.attend_takes(torch.randn(91, 32, 128), keys, vals)
    assert not native.attend_takes(q, keys, vals.float())


def _ggml_weight(qt: T, n: int, k: int):
    """A PackedWeight over random GGUF rows of type qt, [n, k]."""
    codec = quants.get_codec("ggml")
    return codec.view(_random_rows(qt, n, k).reshape(-1), [0], codec.parts(qt, (n, k)), qt, (n, k))


def _count_native_gemms(monkeypatch) -> list[int]:
    """The row counts of every native.gemm call from here on (the calls still run)."""
    calls, real = [], native.gemm
    monkeypatch.setattr(native, "gemm", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    return calls


def test_linear_dispatches_small_batches_to_native_and_large_to_tiles(monkeypatch):
    pw = _ggml_weight(T.Q6_K, 64, 256)
    calls = _count_native_gemms(monkeypatch)
    x = torch.randn(cpu.NATIVE_MAX_M + 8, 256)
    small, big = cpu.linear(x[:2], pw), cpu.linear(x, pw)
    assert calls == [2]
    torch.testing.assert_close(small, big[:2], rtol=Q8_ACTIVATION_REL, atol=Q8_ACTIVATION_REL * big.abs().max().item())


def test_a_prefill_chunk_runs_on_the_native_kernels_on_every_cpu(monkeypatch):
    """A 512-token chunk (fullsize.py's, llama.cpp's n_batch) takes the native kernels, for one
    matrix and for a layer's fused experts, whatever bf16 hardware the CPU has: dequantized tiles
    and torch's bf16 GEMM left oneDNN a compiled primitive per expert shape (0.45 GiB and more
    on the AMX Xeon, peak RSS above the plan's F) and ran slower there (kernels/cpu.py)."""
    pw = _ggml_weight(T.Q4_K, 32, 256)
    calls = _count_native_gemms(monkeypatch)
    cpu.linear(torch.randn(512, 256), pw)
    assert calls == [512]
    assert cpu.native_swiglu_types({"gate": pw, "up": pw, "down": pw}, 512) == (T.Q4_K,) * 3


def test_native_swiglu_types_accepts_only_ggml_blocks_it_can_run():
    mk = _ggml_weight
    parts = {"gate": mk(T.Q4_K, 32, 256), "up": mk(T.Q4_K, 32, 256), "down": mk(T.Q6_K, 256, 256)}
    assert cpu.native_swiglu_types(parts, 1) == (T.Q4_K, T.Q4_K, T.Q6_K)
    assert cpu.native_swiglu_types(parts, cpu.NATIVE_MAX_M + 1) is None
    f32 = quants.get_codec("f32")
    dense = f32.view(torch.zeros(256 * 256 * 4, dtype=torch.uint8), [0], f32.parts(T.F32, (256, 256)), T.F32,
                     (256, 256))
    assert cpu.native_swiglu_types({**parts, "down": dense}, 1) is None


@pytest.mark.parametrize("qt", TYPES)
def test_native_gemm_is_ggml_mul_mat(qt):
    """The oracle: ggml's own CPU mul_mat (the libggml llama-cpp-python ships, in a child process)
    on the same bytes and x. Measured: identical to the last bit for M = 1 and 4 except Q5_K,
    whose per-block float terms ggml sums in another order (~6e-8 relative); within float32
    summation order (~2e-7 relative) for larger M, where ggml switches to its batched kernels."""
    from mawforge.fixtures.ggml_ref import ggml_matmul
    raw = _random_rows(qt, 64, 512, seed=11)
    for m in (1, 4, 32):
        x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m))
        ref = ggml_matmul(raw.numpy(), int(qt), 64, 512, x.numpy())
        got = native.gemm(x, raw, qt, 64, 512).numpy()
        if m <= 4 and qt != T.Q5_K:
            np.testing.assert_array_equal(got, ref)
        else:
            np.testing.assert_allclose(got, ref, rtol=0, atol=NATIVE_REORDER_ATOL_OF_MAX * np.abs(ref).max())


@pytest.mark.parametrize("qt", TYPES)
def test_batched_rows_equal_single_rows_bit_for_bit(qt):
    """Q4_K and Q6_K run four rows of x per weight block (prefill, verify); every type must give
    exactly what one-row calls give, so a token's logits do not depend on its batch."""
    raw = _random_rows(qt, 48, 512, seed=4)
    x = torch.randn(11, 512, generator=torch.Generator().manual_seed(6))
    batched = native.gemm(x, raw, qt, 48, 512)
    single = torch.cat([native.gemm(x[i:i + 1], raw, qt, 48, 512) for i in range(11)])
    assert torch.equal(batched, single)


@pytest.mark.parametrize("qt", TYPES)
def test_paired_weight_rows_equal_one_row_calls_bit_for_bit(qt):
    """qgemm can run weight rows in pairs (Q4_K, Q5_K, Q6_K: one pass over two rows sharing x) and
    four rows of x at a time; every element must be what the one-row kernel gives alone (one
    weight row, one row of x: the path ggml's oracle test pins to ggml's bits)."""
    for n, k in ((7, 256), (48, 512), (33, 768)):
        raw = _random_rows(qt, n, k, seed=n)
        x = torch.randn(64, k, generator=torch.Generator().manual_seed(k)) * 3
        single = torch.stack([torch.cat([native.gemm(x[i:i + 1], raw[j:j + 1], qt, 1, k)[0] for j in range(n)])
                              for i in range(64)])
        for m in (1, 2, 3, 4, 5, 8, 64):
            assert torch.equal(native.gemm(x[:m], raw, qt, n, k), single[:m]), (n, k, m)
        for pair_limit in (0, 1 << 40):      # one row at a time (the default), then rows in pairs
            limit = native.set_pair_limit(pair_limit)
            try:
                assert torch.equal(native.gemm(x[:1], raw, qt, n, k), single[:1]), (n, k, pair_limit)
            finally:
                native.set_pair_limit(limit)


def _expf32(v: np.ndarray) -> np.ndarray:
    """The C library's expf, element by element (the kernels call it; numpy's exp rounds
    differently in the last bit)."""
    import ctypes
    import ctypes.util
    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    libm.expf.argtypes, libm.expf.restype = [ctypes.c_float], ctypes.c_float
    return np.array([libm.expf(float(a)) for a in v.reshape(-1)], np.float32).reshape(v.shape)


@pytest.mark.parametrize("types", [(T.Q4_K, T.Q4_K, T.Q6_K), (T.Q4_K, T.Q4_K, T.Q4_K),
                                   (T.Q5_K, T.Q5_K, T.Q6_K), (T.Q4_K, T.Q5_K, T.Q6_K)])
def test_moe_ffn_is_its_gemms_bit_for_bit(types):
    """moe_ffn (one token: rows one at a time, or gate with up and down rows in pairs under the pair
    limit; more tokens: four at a time) against its definition in float32 from one-matrix gemm
    calls: h = g / (1 + expf(-g)) * u, then out[t] += wt * (down . h) expert by expert, with the
    same roundings, for M from 1 to 64."""
    rng = np.random.default_rng(5)
    c, f, e = 512, 256, 4
    experts = _expert_set(rng, f, c, types, e)
    batch = native.ExpertBatch(types, f, c)
    for g, u, d in experts:
        batch.add(g.data_ptr(), u.data_ptr(), d.data_ptr())
    for m, pair_limit in ((1, 0), (1, 1 << 40), (2, 0), (3, 0), (4, 0), (5, 0), (8, 0), (64, 0)):
        x = torch.randn(m, c, generator=torch.Generator().manual_seed(m))
        wts = rng.random((e, m)).astype(np.float32)
        wts[:, m // 2:][rng.random((e, m - m // 2)) < 0.5] = 0.0   # the later tokens skip some experts
        out = torch.full((m, c), 0.25)
        limit = native.set_pair_limit(pair_limit)   # one token: rows one at a time (default), or in pairs
        try:
            native.moe_ffn(x, batch, wts, out)
        finally:
            native.set_pair_limit(limit)
        want = np.full((m, c), 0.25, np.float32)
        for i, (g, u, d) in enumerate(experts):
            for t in np.nonzero(wts[i])[0]:
                gv = native.gemm(x[t:t + 1], g, types[0], f, c).numpy()
                uv = native.gemm(x[t:t + 1], u, types[1], f, c).numpy()
                h = gv / (np.float32(1) + _expf32(-gv)) * uv
                want[t] += wts[i, t] * native.gemm(torch.from_numpy(h), d, types[2], c, f).numpy()[0]
        assert np.array_equal(out.numpy(), want), m

def test_native_rms_norm_equals_the_torch_path():
    """RMSNorm in one native call (decode steps): the torch code's values up to the last bit of
    the mean (the C loop sums the squares in order, as ggml does; torch's float64 sum in
    another order)."""
    from mawforge.models import base
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(3, 4, 256, generator=g) * 3, torch.randn(256, generator=g)
    torch_path = base.rms_norm(x, w.view(1, 256), 1e-6)                   # a 2-D w keeps the torch code
    torch.testing.assert_close(native.rms_norm(x, w, 1e-6), torch_path, rtol=RMS_NORM_TOL, atol=RMS_NORM_TOL)
    assert torch.equal(base.rms_norm(x, w, 1e-6), native.rms_norm(x, w, 1e-6))


def test_prompt_sized_norm_and_rope_give_each_row_its_own_bits():
    """A prompt's RMSNorm and RoPE (from 65,536 floats on) are split over the team by rows: every
    row is the bits of that row computed alone, at 1 and 2 threads."""
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(300, 2048, generator=g) * 3, torch.randn(2048, generator=g)
    q = torch.randn(300, 8, 64, generator=g)
    ang = torch.rand(300, 32, generator=g) * 50
    cos, sin = ang.cos(), ang.sin()
    alone = torch.cat([native.rms_norm(x[r:r + 1], w, 1e-6) for r in range(300)])
    rot = {neox: torch.cat([native.rope(q[t:t + 1], cos[t:t + 1], sin[t:t + 1], neox) for t in range(300)])
           for neox in (True, False)}
    assert x.numel() >= 1 << 16 and q.numel() >= 1 << 16
    try:
        for threads in (1, 2):
            native.set_thread_limit(threads)
            assert torch.equal(native.rms_norm(x, w, 1e-6), alone), threads
            for neox in (True, False):
                assert torch.equal(native.rope(q, cos, sin, neox), rot[neox]), (threads, neox)
    finally:
        native.set_thread_limit(None)
    assert alone.abs().sum() > 0 and not torch.equal(rot[True], rot[False])


@pytest.mark.parametrize("layout", ["neox", "norm"])
def test_native_rope_equals_the_torch_rotation(layout):
    from mawforge.models import base
    rope = base.Rope(64, 10000.0, layout, torch.device("cpu"))
    x = torch.randn(5, 4, 64, generator=torch.Generator().manual_seed(1))
    pos = torch.tensor([0, 3, 17, 100, 511])
    got = rope(x, pos)
    cos, sin = rope.cos[pos][:, None], rope.sin[pos][:, None]
    if layout == "neox":
        x1, x2 = x[..., :32], x[..., 32:]
        want = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        want = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    assert torch.equal(got, want)


_PROBE = ("import sys; from mawforge.kernels import native;"
          "ok = native.available(); print('AVAILABLE', ok, 'SIMD', native.simd());"
          "print('WHY', native.why_unavailable()); native.available(); native.simd()")


def _fake_cc(tmp_path, script: str) -> str:
    cc = tmp_path / "fake-cc"
    cc.write_text("#!/bin/sh\n" + script)
    cc.chmod(0o755)
    return str(cc)


def _probe(tmp_path, cc: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("MAWFORGE_NATIVE_MARCH", "MAWFORGE_NATIVE")}
    env.update(CC=cc, MAWFORGE_CACHE=str(tmp_path / "cache"))
    return subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True)


def test_a_failing_compiler_is_reported_once_with_its_message(tmp_path):
    """No silent fallback: each failed build prints the compiler's own message once, the reason
    stays queryable, and the torch path is used."""
    r = _probe(tmp_path, _fake_cc(tmp_path, 'echo "fake-cc: error: no such target: $*" >&2; exit 1\n'))
    assert r.returncode == 0, r.stderr
    assert "AVAILABLE False SIMD False" in r.stdout
    assert "WHY compiling kquant_gemm.c, decode_step.c, reader.c failed" in r.stdout
    assert r.stderr.count("build with -march=native failed") == 1
    assert r.stderr.count("build with -march=x86-64 failed") == 1
    assert r.stderr.count("fake-cc: error: no such target") == 2
    assert r.stderr.count("using the torch dequantize-and-multiply path") == 1


def test_a_compiler_without_march_native_gets_the_portable_build(tmp_path):
    """A compiler that does not know this CPU (-march=native refused) still yields the portable
    scalar build, and says why the native one failed."""
    real = C_COMPILER_PATH
    cc = _fake_cc(tmp_path, f'case "$*" in *-march=native*) echo "fake-cc: unknown CPU" >&2; exit 1;; esac\n'
                            f'exec {real} "$@"\n')
    r = _probe(tmp_path, cc)
    assert r.returncode == 0, r.stderr
    assert "AVAILABLE True SIMD False" in r.stdout and "WHY None" in r.stdout
    assert r.stderr.count("fake-cc: unknown CPU") == 1 and "x86-64 failed" not in r.stderr
