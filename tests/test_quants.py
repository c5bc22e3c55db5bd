"""Storage codecs and the kernels on them, against gguf's reference dequantization.

Tolerances (W = dequantize(packed weight), reference computed in float64):
  f32 codec:            |linear(x, w) - x @ W.T| <= 1e-5 * (|x| @ |W|.T) + 1e-6
  every other codec:    |linear(x, w) - x @ W.T| <= 2**-6 * (|x| @ |W|.T)
                        (bf16 rounding of x, of W where not exact, and of the output: 3 * 2**-8;
                        for int8_g32, |W| is |hi plane| + |lo plane|, each rounded on output)
  int8_g32 vs gguf:     |W - W_gguf| <= 2**-8 * |W_gguf|
  int4_g32 vs gguf:     |W - W_gguf| <= 2**-8 * (8 |scale| + |zero|) per group, + float32 slack
"""
import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from mawforge.errors import FormatError, UnsupportedError
from mawforge.codecs import dequant, quants
from mawforge.codecs.quants import PartSpec
from mawforge.kernels import cpu

QUANTIZABLE = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.MXFP4]
# Byte offsets of the f16 scale fields of types gguf cannot quantize: random bytes with
# these set to small positive halves are valid blocks.
RANDOM_BLOCKS = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,), T.Q2_K: (80, 82), T.Q3_K: (108,)}
DENSE = {T.F32: np.float32, T.F16: np.float16}
ALL_TYPES = [T.F32, T.F16, T.BF16, *QUANTIZABLE, *RANDOM_BLOCKS]
INT4_SOURCES = [T.Q4_0, T.Q4_1, T.Q4_K]
SHAPES = [(512, 256), (256, 768)]


def source_bytes(t: T, shape, seed=0) -> np.ndarray:
    n, k = shape
    rng = np.random.default_rng(seed)
    values = rng.standard_normal((n, k)).astype(np.float32) * 0.05
    if t in DENSE:
        return values.astype(DENSE[t]).reshape(-1).view(np.uint8)
    if t == T.BF16:
        return torch.from_numpy(values).bfloat16().view(torch.uint8).numpy().reshape(-1)
    if t in QUANTIZABLE:
        return gguf.quants.quantize(values, t).reshape(-1).view(np.uint8)
    elems, nbytes = gguf.GGML_QUANT_SIZES[t]
    blocks = rng.integers(0, 256, (n * k // elems, nbytes), dtype=np.uint8)
    for off in RANDOM_BLOCKS[t]:
        half = (rng.random(len(blocks)) * 0.01 + 1e-4).astype(np.float16)
        blocks[:, off:off + 2] = half.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(-1)


def reference(raw: np.ndarray, t: T, shape) -> np.ndarray:
    return gguf.quants.dequantize(raw.reshape(shape[0], -1), t).reshape(shape).astype(np.float32)


def pack(codec, raw, t, shape, align=64):
    """Encode, lay the parts out at aligned offsets in one uint8 block, and view them."""
    specs = codec.parts(t, shape)
    arrays = codec.encode(raw, t, shape)
    offsets, pos = [], 0
    for spec in specs:
        offsets.append(pos)
        pos += -(-spec.nbytes // align) * align
    buf = torch.zeros(pos, dtype=torch.uint8)
    for off, spec, arr in zip(offsets, specs, arrays):
        buf[off:off + spec.nbytes] = torch.from_numpy(arr.reshape(-1).view(np.uint8).copy())
    return codec.view(buf, offsets, specs, t, shape)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("t", ALL_TYPES, ids=lambda t: t.name)
def test_exact_codec_is_bit_exact(t, shape):
    raw = source_bytes(t, shape)
    codec = quants.choose_codec(t, "exact")
    w = pack(codec, raw, t, shape)
    got = quants.dequantize(w).numpy()
    assert got.dtype == np.float32 and got.shape == shape
    np.testing.assert_array_equal(got.view(np.uint32), reference(raw, t, shape).view(np.uint32))


@pytest.mark.parametrize("t", ALL_TYPES, ids=lambda t: t.name)
def test_parts_match_encoded_arrays(t):
    shape = (256, 512)
    for layout in ("int4pack", "exact"):
        codec = quants.choose_codec(t, layout, shape)
        specs, arrays = codec.parts(t, shape), codec.encode(source_bytes(t, shape), t, shape)
        assert [a.shape for a in arrays] == [s.shape for s in specs]
        assert [a.nbytes for a in arrays] == [s.nbytes for s in specs]
        assert all(a.flags.c_contiguous for a in arrays)
        again = codec.encode(source_bytes(t, shape), t, shape)
        assert all(np.array_equal(a, b) for a, b in zip(arrays, again))


def test_fast_layout_picks_native_int4_and_keeps_the_rest():
    native = quants.native_int4_codec()
    assert native is not None  # every x86 and arm torch build ships the CPU int4pack kernel
    for t in INT4_SOURCES:
        assert quants.choose_codec(t, "int4pack").name == native
        assert quants.choose_codec(t, "exact").name == "ggml"
        assert quants.choose_codec(t, "int4pack", (40, 256)).name == "ggml"  # rows not a multiple of 16
    assert quants.choose_codec(T.Q8_0, "int4pack").name == native.replace("int4", "int8")
    assert [quants.choose_codec(t, "int4pack").name for t in (T.F32, T.F16, T.BF16, T.Q6_K, T.Q5_K)] == \
        ["f32", "f16", "bf16", "ggml", "ggml"]


@pytest.mark.parametrize("name", ["int4_g32_avx512", "int4_g32_avx2", "int4_g32_scalar"])
@pytest.mark.parametrize("rows", [16, 48, 64, 112, 256])
def test_int4_layouts_roundtrip(name, rows):
    codec = quants.get_codec(name)
    q = np.random.default_rng(rows).integers(0, 16, (rows, 64), dtype=np.uint8)
    packed = codec.pack_nibbles(q)
    assert packed.shape == (rows, 32)
    np.testing.assert_array_equal(codec.unpack_nibbles(torch.from_numpy(packed)).numpy(), q)
    if name == quants.native_int4_codec():
        native = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(q).int(), 1)
        np.testing.assert_array_equal(native.numpy().reshape(rows, 32), packed)


def int4_bound(raw, t, shape):
    """Per-element bound 2**-8 * (8|scale| + |zero|) from the exact float32 scale and zero."""
    _, scale, zero = quants.int4_groups(torch.from_numpy(raw.copy()), t, shape)
    bound = (8 * scale.abs() + zero.abs()) * (2.0 ** -8 + 2.0 ** -20) + 1e-12
    return bound.repeat_interleave(32, dim=1).numpy()


@pytest.mark.parametrize("name", ["int4_g32_avx512", "int4_g32_avx2", "int4_g32_scalar"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("t", INT4_SOURCES, ids=lambda t: t.name)
def test_int4_within_bf16_rounding_bound(t, shape, name):
    raw = source_bytes(t, shape)
    w = pack(quants.get_codec(name), raw, t, shape)
    err = np.abs(quants.dequantize(w).numpy() - reference(raw, t, shape))
    assert (err <= int4_bound(raw, t, shape)).all()
    if t == T.Q4_0:  # zero is 0, so scale-only rounding: at most 8 * 2**-8 * |d|
        assert err.max() > 0


@pytest.mark.parametrize("name", ["int8_g32_avx512", "int8_g32_avx2", "int8_g32_scalar"])
@pytest.mark.parametrize("shape", SHAPES)
def test_int8_planes_within_bf16_scale_rounding(shape, name):
    raw = source_bytes(T.Q8_0, shape)
    w = pack(quants.get_codec(name), raw, T.Q8_0, shape)
    want = reference(raw, T.Q8_0, shape)
    err = np.abs(quants.dequantize(w).numpy() - want)
    assert (err <= np.abs(want) * 2.0 ** -8).all() and err.max() > 0


def check_linear(w, m, seed=1):
    n, k = w.shape
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    y = cpu.linear(x, w)
    assert y.shape == (m, n) and y.dtype == x.dtype
    codec = quants.get_codec(w.codec)
    ref = x.double() @ codec.dequantize(w).double().T
    scale = x.double().abs() @ codec.magnitude(w).double().T
    if w.codec == "f32":
        assert ((y.double() - ref).abs() <= 1e-5 * scale + 1e-6).all()
    else:
        assert ((y.double() - ref).abs() <= 2.0 ** -6 * scale).all()


@pytest.mark.parametrize("layout", ["int4pack", "exact"])
@pytest.mark.parametrize("t", ALL_TYPES, ids=lambda t: t.name)
def test_linear_matches_dequantized_matmul(t, layout):
    shape = (256, 768)
    w = pack(quants.choose_codec(t, layout, shape), source_bytes(t, shape), t, shape)
    for m in (1, 7):
        check_linear(w, m)


@pytest.mark.parametrize("t", [T.Q4_K, T.Q8_0, T.Q6_K, T.F16], ids=lambda t: t.name)
def test_linear_prefill_sizes_and_tiling(t, monkeypatch):
    """Many tokens take the dequantized-tile paths; small tiles exercise the tiled loop."""
    shape = (512, 256)
    w = pack(quants.choose_codec(t, "int4pack", shape), source_bytes(t, shape), t, shape)
    check_linear(w, cpu.INT4PACK_MAX_M + 3)
    monkeypatch.setattr(cpu, "TILE_ELEMENTS", 16 * 256 * 3)
    check_linear(w, 5)
    check_linear(w, cpu.GGML_FP32_MAX_M + 1)


def test_linear_int4_on_a_foreign_layout_falls_back():
    """A pack made for another CPU's layout still computes (dequantized tiles)."""
    shape = (512, 256)
    raw = source_bytes(T.Q4_K, shape)
    for name in ("int4_g32_avx512", "int4_g32_avx2", "int4_g32_scalar"):
        check_linear(pack(quants.get_codec(name), raw, T.Q4_K, shape), 3)
    raw = source_bytes(T.Q8_0, shape)
    for name in ("int8_g32_avx512", "int8_g32_avx2", "int8_g32_scalar"):
        check_linear(pack(quants.get_codec(name), raw, T.Q8_0, shape), 3)


def test_linear_keeps_bf16_activations():
    shape = (256, 256)
    w = pack(quants.choose_codec(T.Q4_0), source_bytes(T.Q4_0, shape), T.Q4_0, shape)
    y = cpu.linear(torch.randn(2, 256).bfloat16(), w)
    assert y.dtype == torch.bfloat16 and y.shape == (2, 256)


@pytest.mark.parametrize("t", ALL_TYPES, ids=lambda t: t.name)
def test_embedding_rows_match_dequantize(t):
    shape = (64, 256)
    raw = source_bytes(t, shape)
    rb = dequant.row_bytes(t, shape[1])
    rows = [3, 0, 63, 17]
    picked = torch.from_numpy(np.stack([raw[r * rb:(r + 1) * rb] for r in rows]))
    got = cpu.embedding_rows(picked, t, shape[1]).numpy()
    np.testing.assert_array_equal(got.view(np.uint32), reference(raw, t, shape)[rows].view(np.uint32))


def test_unsupported_type_and_codec_errors_are_clean():
    with pytest.raises(UnsupportedError, match="Q8_K is not supported; supported: .*Q4_K"):
        quants.choose_codec(T.Q8_K)
    with pytest.raises(UnsupportedError, match="unknown storage codec 'int3'"):
        quants.get_codec("int3")
    with pytest.raises(UnsupportedError, match="layout"):
        quants.choose_codec(T.Q4_0, "sideways")
    with pytest.raises(UnsupportedError, match="divisible by 16"):
        quants.get_codec("int4_g32_avx512").parts(T.Q4_0, (40, 256))


def test_bad_bytes_and_views_are_format_errors():
    codec = quants.get_codec("ggml")
    with pytest.raises(FormatError, match="needs 4352 source bytes"):
        codec.encode(np.zeros(100, np.uint8), T.Q8_0, (16, 256))
    with pytest.raises(FormatError, match="not a multiple"):
        codec.parts(T.Q4_K, (16, 100))
    spec = [PartSpec("weight", "float32", (4, 4))]
    with pytest.raises(FormatError, match="not aligned"):
        quants.get_codec("f32").view(torch.zeros(128, dtype=torch.uint8), [2], spec, T.F32, (4, 4))
    with pytest.raises(FormatError, match="outside"):
        quants.get_codec("f32").view(torch.zeros(32, dtype=torch.uint8), [0], spec, T.F32, (4, 4))
    with pytest.raises(FormatError, match="unknown dtype"):
        PartSpec("x", "float8", (1,))


def test_view_is_zero_copy():
    shape = (256, 256)
    codec = quants.choose_codec(T.Q4_K, "int4pack")
    w = pack(codec, source_bytes(T.Q4_K, shape), T.Q4_K, shape)
    base = w.parts["qweight"].untyped_storage().data_ptr()
    assert w.parts["scales_zeros"].untyped_storage().data_ptr() == base
    assert w.nbytes == codec.nbytes(T.Q4_K, shape)
