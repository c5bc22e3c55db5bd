"""A strict, bounds-checked GGUF header reader that never touches tensor data.

Tensor shapes come back in numpy order (GGUF stores ne[] innermost first); offsets are
absolute. A 3-D expert tensor [n_expert, rows, cols] has the expert outermost, so each
expert is one contiguous byte range.
"""
from __future__ import annotations

import os
import re
import struct
from pathlib import Path
from typing import Any, BinaryIO

from gguf import GGML_QUANT_SIZES, GGUF_MAGIC, GGMLQuantizationType as QT, GGUFValueType as VT

from mawforge.errors import FormatError, UnsupportedError
from mawforge.formats import names
from mawforge.formats.config import from_gguf_metadata
from mawforge.formats.source import ExpertTensor, Source, TensorInfo

_SCALAR = {
    VT.UINT8: "<B", VT.INT8: "<b", VT.UINT16: "<H", VT.INT16: "<h", VT.UINT32: "<I",
    VT.INT32: "<i", VT.FLOAT32: "<f", VT.BOOL: "<?", VT.UINT64: "<Q", VT.INT64: "<q",
    VT.FLOAT64: "<d",
}
_MAX_STR = 1 << 24
_MAX_ARRAY = 1 << 26
_MAX_NESTING = 2        # an array of arrays at most (llama.cpp writes none deeper)
_MAX_DIM = 1 << 40      # one dimension; products are checked against the file size anyway


class _Reader:
    def __init__(self, f: BinaryIO, size: int, name: str):
        self.f, self.size, self.name = f, size, name

    def take(self, n: int) -> bytes:
        if n > self.size - self.f.tell():       # checked before reading: no allocation of a bogus n
            raise FormatError(f"{self.name}: truncated GGUF header (needed {n} bytes at offset "
                              f"{self.f.tell()}, file has {self.size})")
        b = self.f.read(n)
        if len(b) != n:
            raise FormatError(f"{self.name}: truncated GGUF header (needed {n} bytes at offset "
                              f"{self.f.tell() - len(b)}, file has {self.size})")
        return b

    def scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.scalar("<Q")
        if n > _MAX_STR:
            raise FormatError(f"{self.name}: malformed GGUF (string of {n} bytes)")
        try:
            return self.take(n).decode("utf-8")
        except UnicodeDecodeError:
            raise FormatError(f"{self.name}: malformed GGUF (string is not UTF-8)") from None

    def value(self, vt: int, depth: int = 0) -> Any:
        try:
            vt = VT(vt)
        except ValueError:
            raise FormatError(f"{self.name}: malformed GGUF (unknown value type {vt})") from None
        if vt == VT.STRING:
            return self.string()
        if vt == VT.ARRAY:
            et, n = self.scalar("<I"), self.scalar("<Q")
            if n > _MAX_ARRAY:
                raise FormatError(f"{self.name}: malformed GGUF (array of {n} items)")
            if depth >= _MAX_NESTING:
                raise FormatError(f"{self.name}: malformed GGUF (arrays nested deeper than {_MAX_NESTING})")
            if et in _SCALAR:
                fmt = _SCALAR[VT(et)]
                sz = struct.calcsize(fmt)
                return list(struct.unpack(f"<{n}{fmt[1]}", self.take(n * sz)))
            return [self.value(et, depth + 1) for _ in range(n)]
        return self.scalar(_SCALAR[vt])


def read_header(path: Path) -> tuple[dict[str, Any], list[TensorInfo], int]:
    """Metadata, tensor table (raw GGUF names) and data offset of a GGUF file."""
    size = os.path.getsize(path)
    with open(path, "rb", buffering=1 << 20) as f:
        r = _Reader(f, size, path.name)
        if size < 24 or r.scalar("<I") != GGUF_MAGIC:
            raise FormatError(f"{path.name}: not a GGUF file (bad magic)")
        version = r.scalar("<I")
        if version not in (2, 3):
            raise FormatError(f"{path.name}: GGUF version {version} is not supported (2 or 3)")
        n_tensors, n_kv = r.scalar("<Q"), r.scalar("<Q")
        if n_tensors > 1 << 20 or n_kv > 1 << 20:
            raise FormatError(f"{path.name}: malformed GGUF ({n_tensors} tensors, {n_kv} keys)")
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = r.string()
            meta[key] = r.value(r.scalar("<I"))
        raw = []
        for _ in range(n_tensors):
            name = r.string()
            nd = r.scalar("<I")
            if not 1 <= nd <= 4:
                raise FormatError(f"{path.name}: malformed GGUF ({name} has {nd} dims)")
            ne = [r.scalar("<Q") for _ in range(nd)]
            if not all(0 < d <= _MAX_DIM for d in ne):
                raise FormatError(f"{path.name}: malformed GGUF ({name} has dims {ne})")
            t = r.scalar("<I")
            try:
                qt = QT(t)
            except ValueError:
                raise UnsupportedError(f"{path.name}: tensor {name} has unknown ggml type {t}") from None
            raw.append((name, tuple(reversed(ne)), qt, r.scalar("<Q")))
        align = meta.get("general.alignment", 32)
        if type(align) is not int or align <= 0 or align & (align - 1):
            raise FormatError(f"{path.name}: malformed GGUF (alignment {align})")
        data_offset = -(-f.tell() // align) * align
    if len({name for name, *_ in raw}) != len(raw):
        raise FormatError(f"{path.name}: malformed GGUF (a tensor name appears twice)")
    tensors = []
    for name, shape, qt, rel in raw:
        if qt not in GGML_QUANT_SIZES:
            raise UnsupportedError(f"{path.name}: tensor {name} has ggml type {qt.name}, which has no size")
        block, tsize = GGML_QUANT_SIZES[qt]
        n = 1
        for s in shape:
            n *= s
        nbytes = n // block * tsize
        off = data_offset + rel
        if rel % align:
            raise FormatError(f"{path.name}: malformed GGUF (tensor {name} at offset {rel} is not "
                              f"aligned to {align})")
        if off + nbytes > size:
            raise FormatError(f"{path.name} is truncated: tensor {name} ends at byte {off + nbytes}, "
                              f"file has {size}")
        tensors.append(TensorInfo(name, qt, shape, path, off, nbytes))
    _no_overlap(path.name, [(t.offset, t.nbytes, t.name) for t in tensors])
    return meta, tensors, data_offset


def _no_overlap(fname: str, ranges: list[tuple[int, int, str]]) -> None:
    """Tensor byte ranges must not share bytes: a crafted table could otherwise alias one
    tensor's bytes as another's."""
    end, last = 0, None
    for off, n, name in sorted(ranges):
        if off < end:
            raise FormatError(f"{fname}: malformed (tensors {last} and {name} overlap)")
        end, last = off + n, name


SHARD_RE = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def shard_paths(path: Path) -> list[Path]:
    """The files of one GGUF model: [path] for a single file; every shard of a split model
    (`name-00001-of-0000N.gguf`, llama.cpp's gguf-split naming) given any one of them or the
    directory that holds them. One-line FormatError naming a missing shard or a directory that
    holds no set, or more than one."""
    path = Path(path)
    if path.is_dir():
        firsts = sorted(f for f in path.iterdir() if (m := SHARD_RE.match(f.name)) and int(m["no"]) == 1)
        singles = sorted(f for f in path.iterdir() if f.suffix == ".gguf" and not SHARD_RE.match(f.name))
        if len(firsts) + len(singles) != 1:
            found = ", ".join(f.name for f in (*firsts, *singles)) or "no .gguf file"
            raise FormatError(f"{path}: a directory of one GGUF model needs exactly one file or one shard set "
                              f"(name-00001-of-0000N.gguf); found {found}")
        path = (firsts or singles)[0]
    m = SHARD_RE.match(path.name)
    if m is None:
        return [path]
    count = int(m["count"])
    if not 1 <= int(m["no"]) <= count:
        raise FormatError(f"{path.name}: shard number {int(m['no'])} is not within 1..{count}")
    shards = [path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    for i, f in enumerate(shards, 1):
        if not f.is_file():
            raise FormatError(f"{f.name}: shard {i} of {count} is missing (beside {path.name})")
    return shards


def _read_shards(shards: list[Path]) -> tuple[dict[str, Any], list[TensorInfo]]:
    """The model's metadata (the first shard's, as llama.cpp reads it) and every shard's tensors;
    a shard of another split (its split.count, split.no or split.tensors.count disagree, its
    architecture differs, or it repeats a tensor) is a one-line error naming it."""
    meta, tensors = {}, []
    names_seen: dict[str, str] = {}
    total = None
    for i, f in enumerate(shards):
        m, ts, _ = read_header(f)
        if len(shards) > 1:
            count, no, n = m.get("split.count"), m.get("split.no"), m.get("split.tensors.count")
            if count != len(shards) or no != i:
                raise FormatError(f"{f.name}: not shard {i + 1} of this {len(shards)}-shard model (its split keys say "
                                  f"shard {no if no is None else no + 1} of {count})")
            total = n if total is None else total
            if n != total:
                raise FormatError(f"{f.name}: belongs to another split model ({n} tensors in all; the first shard "
                                  f"says {total})")
            arch = m.get("general.architecture")
            if i and arch is not None and arch != meta.get("general.architecture"):
                raise FormatError(f"{f.name}: belongs to another model (architecture {arch}, the first shard "
                                  f"says {meta.get('general.architecture')})")
        if i == 0:
            meta = m
        for t in ts:
            if t.name in names_seen:
                raise FormatError(f"{names_seen[t.name]} and {f.name} both hold tensor {t.name}: shards of two models")
            names_seen[t.name] = f.name
        tensors += ts
    if total is not None and total != len(tensors):
        raise FormatError(f"{shards[0].name}: the shards hold {len(tensors)} tensors, the split says {total}")
    return meta, tensors


def open_gguf(path: Path) -> Source:
    """A GGUF model: one file, or a shard set given by any shard or its directory."""
    shards = shard_paths(path)
    path = shards[0]
    meta, tensors = _read_shards(shards)
    common: dict[str, TensorInfo] = {}
    per_expert: dict[tuple[int, str], dict[int, TensorInfo]] = {}
    experts: dict[tuple[int, str], ExpertTensor] = {}
    for t in tensors:
        en = names.gguf_expert(t.name)
        if en is None:
            common[t.name] = t
        elif en.expert is None:
            bias = en.kind.endswith("_bias") and len(t.shape) == 2       # gpt-oss [E, F] expert biases
            if len(t.shape) != 3 and not bias:
                raise FormatError(f"{path.name}: expert tensor {t.name} is not 3-D: {list(t.shape)}")
            e_count, n_rows, k = (t.shape[0], 1, t.shape[1]) if bias else t.shape
            per = t.nbytes // e_count       # dims are checked positive by read_header
            experts[(en.layer, en.kind)] = ExpertTensor(
                en.layer, en.kind, t.qtype, (n_rows, k),
                tuple((t.path, t.offset + e * per, per) for e in range(e_count)))
        else:
            if len(t.shape) != 2:
                raise FormatError(f"{path.name}: expert tensor {t.name} is not 2-D: {list(t.shape)}")
            per_expert.setdefault((en.layer, en.kind), {})[en.expert] = t
    for (layer, kind), by_e in per_expert.items():
        if sorted(by_e) != list(range(len(by_e))):
            raise FormatError(f"{path.name}: layer {layer} {kind} experts are not numbered 0..{len(by_e) - 1}")
        if len({(t.qtype, t.shape) for t in by_e.values()}) != 1:
            raise FormatError(f"{path.name}: layer {layer} {kind} experts differ in type or shape")
        ts = [by_e[e] for e in sorted(by_e)]
        experts[(layer, kind)] = ExpertTensor(layer, kind, ts[0].qtype, ts[0].shape,
                                              tuple((t.path, t.offset, t.nbytes) for t in ts))
    emb = common.get("token_embd.weight")
    if emb is None:
        raise FormatError(f"{path.name}: no token_embd.weight tensor")
    cfg = from_gguf_metadata(meta, vocab=emb.shape[0])
    if "output.weight" not in common:
        cfg = type(cfg).from_dict({**cfg.to_dict(), "tie_embeddings": True})
    return Source("gguf", path, cfg, meta, common, experts, files=shards)
