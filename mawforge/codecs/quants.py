"""Storage codecs: the layouts the pack stores and the runtime computes on.

A source tensor (raw GGUF bytes of one GGMLQuantizationType, or dense F32/F16/BF16) is
encoded at pack time into one or more *parts* (named, typed byte ranges). At run time the
block's bytes sit in a uint8 buffer and `Codec.view` turns its parts into zero-copy
tensors, wrapped in a `PackedWeight` that `mawforge.kernels.cpu.linear` computes on.

Codecs, by name:
  f32, f16, bf16      dense, byte-exact
  ggml                the GGUF blocks byte-exact (any type gguf can dequantize)
  int4_g32_<layout>   Q4_0/Q4_1/Q4_K transcoded to torch's CPU int4pack weight plus bf16
                      scales_and_zeros; w = (q - 8) * scale + zero per group of 32.
                      The packed weight layout depends on the CPU kernel torch dispatches to
                      (avx512: 64-row blocks, avx2 and the scalar kernel: 32-row blocks, see
                      aten/src/ATen/native/cpu/int4mm_kernel.cpp), so the layout is part of
                      the codec name and recorded in the pack.
  int8_g32_<layout>   Q8_0 as two int4 planes on the same kernel (see _Int8G32);
                      |w - w_gguf| <= 2**-8 * |w_gguf|.
  Rounding bound of int4_g32 against gguf's dequantization, per element of group g:
      |w_int4 - w_gguf| <= 2**-8 * (8 * |scale_g| + |zero_g|) (+ float32 rounding)
  (scale and zero are rounded once to bf16; Q4_0 has zero = 0 so the bound is 8 * 2**-8 * |d|.)

Legend: N = rows (output features), K = row length (input features), G = K / 32 groups.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from mawforge.errors import FormatError, UnsupportedError
from mawforge.codecs import dequant

TORCH_DTYPES = {
    "uint8": torch.uint8, "int8": torch.int8, "int32": torch.int32,
    "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
}
_ITEMSIZE = {name: torch.empty(0, dtype=dt).element_size() for name, dt in TORCH_DTYPES.items()}


@dataclass(frozen=True)
class PartSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self):
        if self.dtype not in TORCH_DTYPES:
            raise FormatError(f"part {self.name!r} has unknown dtype {self.dtype!r}; known: {', '.join(TORCH_DTYPES)}")
        if any(int(d) < 0 for d in self.shape):
            raise FormatError(f"part {self.name!r} has a negative dimension in {self.shape}")
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self.dtype]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.itemsize


@dataclass(frozen=True, eq=False)
class PackedWeight:
    """A weight [N, K] in a storage codec; parts are tensors (views into a block buffer)."""
    codec: str
    ggml_type: T
    shape: tuple[int, int]
    parts: dict[str, torch.Tensor] = field(repr=False)

    def __post_init__(self):
        if len(self.shape) != 2 or min(self.shape) <= 0:
            raise FormatError(f"a packed weight needs a 2-D shape (N, K), got {self.shape}")

    @property
    def device(self) -> torch.device:
        return next(iter(self.parts.values())).device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts.values())


class Codec:
    """A storage layout. Subclasses register with `class X(Codec, name="...")`."""

    registry: dict[str, Codec] = {}
    name: str

    def __init_subclass__(cls, name: str | None = None, **kwargs):
        super().__init_subclass__(**kwargs)
        if name is not None:
            cls.name = name
            Codec.registry[name] = cls()

    def supports(self, ggml_type: T) -> bool:
        raise NotImplementedError

    def parts(self, ggml_type: T, shape: tuple[int, int]) -> list[PartSpec]:
        raise NotImplementedError

    def encode(self, raw: np.ndarray, ggml_type: T, shape: tuple[int, int]) -> list[np.ndarray]:
        raise NotImplementedError

    def dequantize(self, w: PackedWeight) -> torch.Tensor:
        raise NotImplementedError

    def magnitude(self, w: PackedWeight) -> torch.Tensor:
        """|W| summed over the pieces a kernel rounds separately (error analysis, tests)."""
        return self.dequantize(w).abs()

    def nbytes(self, ggml_type: T, shape: tuple[int, int]) -> int:
        return sum(p.nbytes for p in self.parts(ggml_type, shape))

    def view(self, buf: torch.Tensor, offsets: list[int], parts: list[PartSpec],
             ggml_type: T, shape: tuple[int, int]) -> PackedWeight:
        """Zero-copy views of `parts` at byte `offsets` of a 1-D uint8 buffer (any device)."""
        if buf.dtype != torch.uint8 or buf.dim() != 1:
            raise FormatError("a block buffer must be a 1-D uint8 tensor")
        if len(offsets) != len(parts):
            raise FormatError(f"{len(parts)} parts but {len(offsets)} offsets")
        views = {}
        for off, spec in zip(offsets, parts):
            if off < 0 or off + spec.nbytes > buf.numel():
                raise FormatError(f"part {spec.name!r} [{off}, {off + spec.nbytes}) "
                                  f"lies outside a {buf.numel()}-byte block")
            if (buf.storage_offset() + off) % spec.itemsize:
                raise FormatError(f"part {spec.name!r} at byte {off} is not aligned to its {spec.itemsize}-byte dtype")
            views[spec.name] = buf[off:off + spec.nbytes].view(TORCH_DTYPES[spec.dtype]).view(spec.shape)
        return PackedWeight(self.name, T(ggml_type), (int(shape[0]), int(shape[1])), views)

    def view_plan(self, block_bytes: int, offsets: list[int], parts: list[PartSpec], ggml_type: T,
                  shape: tuple[int, int]):
        """`view`'s checks made once for a layout inside any `block_bytes`-byte buffer whose start is
        page-aligned (an expert slot); returns make(buf) -> PackedWeight, which only slices. The
        expert cache binds a block on every read, so the checks (and their numpy) are not redone."""
        self.view(torch.empty(block_bytes, dtype=torch.uint8, device="meta"), offsets, parts, ggml_type, shape)
        name, qt, shp = self.name, T(ggml_type), (int(shape[0]), int(shape[1]))
        cuts = [(spec.name, off, off + spec.nbytes, TORCH_DTYPES[spec.dtype], spec.shape)
                for off, spec in zip(offsets, parts)]

        def make(buf: torch.Tensor) -> PackedWeight:
            return PackedWeight(name, qt, shp, {n: buf[a:b].view(dt).view(sh) for n, a, b, dt, sh in cuts})
        return make


def _check_raw(raw: np.ndarray, ggml_type: T, shape: tuple[int, int]) -> np.ndarray:
    n, k = shape
    want = n * dequant.row_bytes(ggml_type, k)
    flat = np.ascontiguousarray(raw).reshape(-1)
    if flat.dtype != np.uint8 or flat.size != want:
        raise FormatError(f"{ggml_type.name} {n}x{k} needs {want} source bytes, got {flat.size} of {flat.dtype}")
    return flat


class _Dense(Codec):
    ggml_type: T
    dtype: str
    np_dtype: type

    def supports(self, ggml_type):
        return ggml_type == self.ggml_type

    def parts(self, ggml_type, shape):
        return [PartSpec("weight", self.dtype, tuple(shape))]

    def encode(self, raw, ggml_type, shape):
        return [_check_raw(raw, ggml_type, shape).view(self.np_dtype).reshape(shape)]

    def dequantize(self, w):
        return w.parts["weight"].float()


class F32(_Dense, name="f32"):
    ggml_type, dtype, np_dtype = T.F32, "float32", np.float32


class F16(_Dense, name="f16"):
    ggml_type, dtype, np_dtype = T.F16, "float16", np.float16


class BF16(_Dense, name="bf16"):
    ggml_type, dtype, np_dtype = T.BF16, "bfloat16", np.uint16  # numpy has no bf16: bit patterns


_GGUF_TYPES = set(getattr(gguf.quants, "_type_traits", {})) | set(dequant.BlockDequant.registry)


class Ggml(Codec, name="ggml"):
    """The GGUF blocks as stored: rows of whole blocks, computed on by dequantizing tiles."""

    def supports(self, ggml_type):
        return ggml_type in _GGUF_TYPES

    def parts(self, ggml_type, shape):
        return [PartSpec("blocks", "uint8", (shape[0], dequant.row_bytes(ggml_type, shape[1])))]

    def encode(self, raw, ggml_type, shape):
        return [_check_raw(raw, ggml_type, shape).reshape(shape[0], -1)]

    def dequantize(self, w):
        return dequant.dequantize_rows(w.parts["blocks"], w.ggml_type, w.shape[1])


# --- int4 groups of 32 on torch's CPU int4pack kernel -----------------------------------

def get_codec(name: str) -> Codec:
    try:
        return Codec.registry[name]
    except KeyError:
        raise UnsupportedError(f"unknown storage codec {name!r}; known: {', '.join(sorted(Codec.registry))}") from None


def supported_types() -> list[str]:
    names = {t.name for codec in Codec.registry.values() for t in T if codec.supports(t)}
    return sorted(names)


LAYOUTS = ("exact", "int4pack")
LAYOUT_ALIASES = {"fast": "int4pack"}     # the int4pack layout's name before the native kernels


def pack_layout(name: str) -> str:
    """The layout a user-given name means ('fast' is the old name of 'int4pack')."""
    layout = LAYOUT_ALIASES.get(name, name)
    if layout not in LAYOUTS:
        raise UnsupportedError(f"pack layout must be one of {', '.join(LAYOUTS)}, got {name!r}")
    return layout


def choose_codec(ggml_type: T, layout: str = "exact", shape: tuple[int, int] | None = None) -> Codec:
    """The codec to store a tensor of `ggml_type` in. 'exact' (the default) keeps the source
    bytes, which the native kernels compute on as llama.cpp does; 'int4pack' transcodes
    Q4_0/Q4_1/Q4_K (and Q8_0, as two planes) to this CPU's torch int4_g32 layout where the
    shape allows (for machines without a C compiler, where the native kernels cannot build)."""
    layout = pack_layout(layout)
    ggml_type = T(ggml_type)
    native = native_int4_codec()
    shape_ok = shape is None or (shape[0] % 16 == 0 and shape[1] % 32 == 0)
    if layout == "int4pack" and native and shape_ok:
        for name in (native, native.replace("int4", "int8")):
            if Codec.registry[name].supports(ggml_type):
                return Codec.registry[name]
    for name in ("f32", "f16", "bf16", "ggml"):
        if Codec.registry[name].supports(ggml_type):
            return Codec.registry[name]
    raise UnsupportedError(f"quant type {ggml_type.name} is not supported; supported: {', '.join(supported_types())}")


def dequantize(w: PackedWeight) -> torch.Tensor:
    """Reference float32 [N, K] of a packed weight (tests, embeddings, fallbacks)."""
    return get_codec(w.codec).dequantize(w)


# the int4pack codecs register themselves as Codec subclasses (they import this module's base)
from mawforge.codecs.int4pack import int4_groups, native_int4_codec  # noqa: E402,F401
