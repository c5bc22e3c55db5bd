"""The split-pack format: manifest.json, common.bin, experts.pack and experts.index.

See docs/pack-format.md. Records here are plain frozen dataclasses that validate
themselves when read back, so a damaged or foreign pack is a one-line error.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import xxhash

from mawforge.errors import FormatError
from mawforge.formats import jsonio
from mawforge.formats.config import ModelConfig
from mawforge.pack.fields import MAX_OFFSET, _hex, _int, _list, _obj, _shape, _str  # noqa: F401
from mawforge.pack.sources import PAGE, SourceFile, SourceRange, resolve_source  # noqa: F401  (re-exported)

FORMAT = "mawforge-pack"
# 2: the index's layer templates carry a digest, the manifest carries the index file's digest,
# its own digest and the tokenizer files' digests, and pack_digest covers all of them.
# Version 1 packs are still read; `verify` says what it cannot check in them.
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
MANIFEST, COMMON, EXPERTS, INDEX = "manifest.json", "common.bin", "experts.pack", "experts.index"


def digest(data) -> str:
    """128-bit block digest (xxh3-128), hex."""
    return xxhash.xxh3_128_hexdigest(data)


def file_digest(path: Path, chunk: int = 4 << 20) -> str:
    """xxh3-128 of a whole file, read `chunk` bytes at a time (the tokenizer files' digests)."""
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def canonical(obj) -> bytes:
    """The bytes a JSON value's digest is taken over: sorted keys, no whitespace."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Part:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int      # relative to the tensor's block (experts) or absolute (common.bin)
    nbytes: int

    @classmethod
    def from_dict(cls, d: dict, what: str = "part") -> "Part":
        d = _obj(d, what)
        return cls(_str(d.get("name"), f"{what} name"), _str(d.get("dtype"), f"{what} dtype"),
                   _shape(d.get("shape"), f"{what} shape"), _int(d.get("offset"), f"{what} offset"),
                   _int(d.get("nbytes"), f"{what} nbytes"))


@dataclass(frozen=True)
class TensorRecord:
    """One stored tensor: where its parts lie, in which codec, from which source type."""
    name: str          # canonical name (common) or kind (gate/up/down/gate_up) in a block
    qtype: str         # source GGML type name, e.g. Q4_K
    codec: str         # storage codec, e.g. int4_g32
    shape: tuple[int, ...]
    parts: tuple[Part, ...]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["parts"] = [asdict(p) for p in self.parts]
        return d

    @classmethod
    def from_dict(cls, d: dict, what: str = "tensor") -> "TensorRecord":
        d = _obj(d, what)
        name = _str(d.get("name"), f"{what} name")
        what = f"{what} {name[:80]}"
        parts = _list(d.get("parts"), f"{what} parts")
        if not parts:
            raise FormatError(f"{what} has no parts")
        return cls(name, _str(d.get("qtype"), f"{what} qtype"), _str(d.get("codec"), f"{what} codec"),
                   _shape(d.get("shape"), f"{what} shape"),
                   tuple(Part.from_dict(p, f"{what} part") for p in parts))


@dataclass(frozen=True)
class LayerBlocks:
    """All experts of one layer share a block template; each block has an offset and digest.

    In an in-place pack (`sources` set, one range per tensor) the blocks are not in experts.pack:
    each tensor's bytes are read from its source file into the slot at its part's offset (every
    part on a page boundary, a page after the previous part's last page, so the page-aligned
    supersets the reader threads read at once never overlap), and a block's digest covers its
    parts' bytes, not the gaps."""
    layer: int
    block_nbytes: int                     # logical bytes (padding excluded)
    tensors: tuple[TensorRecord, ...]     # part offsets relative to the block start
    offsets: tuple[int, ...]              # per expert, absolute in experts.pack (0 in place)
    digests: tuple[str, ...]              # per expert, xxh3-128 of the block's bytes
    tensors_digest: str = ""              # xxh3-128 of the template (format 2; "" in format 1)
    sources: tuple[SourceRange, ...] = ()

    @property
    def logical_nbytes(self) -> int:
        """A block's own bytes: in place its parts' (the pages between them are not the model's)."""
        return sum(p.nbytes for t in self.tensors for p in t.parts) if self.sources else self.block_nbytes

    @property
    def slot_nbytes(self) -> int:
        """Bytes of a slot holding one block: page-rounded, and in place one page more, which
        the last tensor's page-aligned superset read runs into."""
        return -(-self.block_nbytes // PAGE) * PAGE + (PAGE if self.sources else 0)

    def template(self) -> dict:
        return {"layer": self.layer, "block_nbytes": self.block_nbytes,
                "tensors": [t.to_dict() for t in self.tensors]}

    def template_digest(self) -> str:
        return digest(canonical(self.template()))

    def to_dict(self) -> dict:
        d = {**self.template(), "tensors_digest": self.template_digest(),
             "blocks": [[o, d] for o, d in zip(self.offsets, self.digests)]}
        if self.sources:
            d["sources"] = [r.to_dict() for r in self.sources]
        return d

    @classmethod
    def from_dict(cls, d: dict, version: int = FORMAT_VERSION, n_files: int = 0) -> "LayerBlocks":
        d = _obj(d, "layer entry")
        layer = _int(d.get("layer"), "layer", 0, 1 << 16)
        what = f"layer {layer}"
        size = _int(d.get("block_nbytes"), f"{what} block_nbytes")
        tensors = tuple(TensorRecord.from_dict(t, f"{what} tensor") for t in _list(d.get("tensors"), f"{what} tensors"))
        for t in tensors:
            for p in t.parts:
                if p.offset + p.nbytes > size:
                    raise FormatError(f"{what} {t.name}.{p.name} ends at {p.offset + p.nbytes}, past the "
                                      f"block's {size} bytes")
        blocks = _list(d.get("blocks"), f"{what} blocks")
        for i, b in enumerate(blocks):
            if not isinstance(b, list) or len(b) != 2:
                raise FormatError(f"{what} block {i} must be [offset, digest]")
        offsets = tuple(_int(b[0], f"{what} block {i} offset") for i, b in enumerate(blocks))
        digests = tuple(_hex(b[1], f"{what} block {i} digest") for i, b in enumerate(blocks))
        td = _hex(d.get("tensors_digest"), f"{what} tensors_digest") if version >= 2 else ""
        sources = ()
        if n_files:
            sources = tuple(SourceRange.from_dict(r, f"{what} source", n_files)
                            for r in _list(d.get("sources"), f"{what} sources"))
            if len(sources) != len(tensors):
                raise FormatError(f"{what}: {len(sources)} source ranges for {len(tensors)} tensors")
            room = 0        # each part's page-aligned superset must end before the next part's page
            for t, r in zip(tensors, sources):
                off = t.parts[0].offset if len(t.parts) == 1 else -1
                start, head = off - off % PAGE, off % PAGE
                if off < 0 or start < room:
                    raise FormatError(f"{what} {t.name}: an in-place tensor is one part in a page of its own, a "
                                      "page past the previous one's last page")
                if head and any(o % PAGE != head for o in r.offsets):
                    raise FormatError(f"{what} {t.name}: the part starts {head} bytes into a page, where not "
                                      "every expert's bytes start in the source")
                room = start + -(-(head + t.parts[0].nbytes) // PAGE) * PAGE + PAGE
                if len(r.offsets) != len(offsets):
                    raise FormatError(f"{what} {t.name}: {len(r.offsets)} source offsets for {len(offsets)} blocks")
        elif "sources" in d:
            raise FormatError(f"{what} has source ranges but the index names no source files")
        return cls(layer, size, tensors, offsets, digests, td, sources)


@dataclass(frozen=True)
class ExpertIndex:
    alignment: int
    layers: tuple[LayerBlocks, ...]
    files: tuple[SourceFile, ...] = ()    # in place: the source files the blocks are read from

    @property
    def in_place(self) -> bool:
        return bool(self.files)

    def block(self, layer: int, expert: int) -> tuple[int, int, str]:
        lb = self.layers[layer]
        return lb.offsets[expert], lb.block_nbytes, lb.digests[expert]

    def block_bytes(self) -> list[int]:
        return [lb.block_nbytes for lb in self.layers]

    @property
    def n_experts(self) -> int:
        return max((len(lb.offsets) for lb in self.layers), default=0)

    def total_bytes(self) -> int:
        return sum(lb.logical_nbytes * len(lb.offsets) for lb in self.layers)

    def to_json(self) -> str:
        d = {"format": FORMAT, "format_version": FORMAT_VERSION, "alignment": self.alignment,
             "layers": [lb.to_dict() for lb in self.layers]}
        if self.files:
            d["source_files"] = [f.to_dict() for f in self.files]
        return json.dumps(d, separators=(",", ":"))


@dataclass(frozen=True)
class Manifest:
    config: ModelConfig
    source: dict
    pack_digest: str
    alignment: int
    layout: str
    transforms: tuple[dict, ...]
    byte_totals: dict
    common: tuple[TensorRecord, ...]      # offsets absolute in common.bin
    common_digests: dict
    tokenizer: dict
    version: int = FORMAT_VERSION
    index_digest: str = ""                # xxh3-128 of experts.index's bytes (format 2)

    def common_record(self, name: str) -> TensorRecord | None:
        for t in self.common:
            if t.name == name:
                return t
        return None

    def to_json(self) -> str:
        d = {"format": FORMAT, "format_version": FORMAT_VERSION, "arch": self.config.arch,
             "config": self.config.to_dict(), "source": self.source, "pack_digest": self.pack_digest,
             "alignment": self.alignment, "layout": self.layout, "transforms": list(self.transforms),
             "bytes": self.byte_totals, "common": [t.to_dict() for t in self.common],
             "common_digests": self.common_digests, "tokenizer": self.tokenizer,
             "index_digest": self.index_digest}
        d["manifest_digest"] = manifest_digest(d)
        return json.dumps(d, indent=1)


def manifest_digest(d: dict) -> str:
    """xxh3-128 over the manifest's canonical JSON without its own manifest_digest field."""
    return digest(canonical({k: v for k, v in d.items() if k != "manifest_digest"}))


def load_json(path: Path) -> dict:
    """A pack JSON file, bounded and checked: an object of this format and a readable version."""
    if not path.parent.exists():
        raise FormatError(f"{path.parent}: no such pack directory")
    if not path.parent.is_dir():
        raise FormatError(f"{path.parent}: not a directory (a pack is a directory)")
    if not path.exists():
        raise FormatError(f"{path.parent}: not a MawForge pack (no {path.name})")
    d = jsonio.load_file(path)
    if d.get("format") != FORMAT:
        raise FormatError(f"{path}: not a MawForge pack file")
    if d.get("format_version") not in READABLE_VERSIONS:
        raise FormatError(f"{path}: pack format version {d.get('format_version')!r} "
                          f"(this MawForge reads {', '.join(map(str, READABLE_VERSIONS))})"[:300])
    return d


def manifest_from_dict(d: dict, where: str) -> Manifest:
    try:
        version = d["format_version"]
        common = tuple(TensorRecord.from_dict(t, "common tensor") for t in _list(d.get("common"), "common"))
        digests = _obj(d.get("common_digests"), "common_digests")
        for name, h in digests.items():
            _hex(h, f"common_digests[{name[:80]}]")
        tok = _obj(d.get("tokenizer"), "tokenizer")
        for f in _list(tok.get("files", []), "tokenizer files"):
            if not isinstance(f, str) or Path(f).name != f or f.startswith("."):
                raise FormatError(f"tokenizer file {f!r} is not a plain file name"[:200])
        tf = tuple(_obj(t, "transform") for t in _list(d.get("transforms"), "transforms"))
        byte_totals = _obj(d.get("bytes"), "bytes")
        for k in ("common", "embedding", "experts", "expert_blocks", "common_file", "experts_file"):
            _int(byte_totals.get(k), f"bytes.{k}")
        idx = _hex(d.get("index_digest"), "index_digest") if version >= 2 else ""
        return Manifest(ModelConfig.from_dict(d.get("config")), _obj(d.get("source"), "source"),
                        _hex(d.get("pack_digest"), "pack_digest"),
                        _alignment(d.get("alignment")), _str(d.get("layout"), "layout"), tf, byte_totals,
                        common, digests, tok, version, idx)
    except FormatError as e:
        raise FormatError(f"{where}: {e}") from None


def _alignment(v) -> int:
    a = _int(v, "alignment", 1, 1 << 31)
    if a & (a - 1):
        raise FormatError(f"alignment must be a power of two, got {a}")
    return a


def read_manifest(pack: Path) -> Manifest:
    """The manifest, checked field by field; a format 2 manifest whose values were edited
    after packing (its manifest_digest no longer matches) is refused here, so plan, run and
    serve never act on hand-edited values. `verify` reads it without this check and reports."""
    d = load_json(Path(pack) / MANIFEST)
    man = manifest_from_dict(d, f"{pack}/{MANIFEST}")
    if man.version >= 2 and d.get("manifest_digest") != manifest_digest(d):
        raise FormatError(f"{pack}/{MANIFEST} was edited after packing (manifest_digest does not match); "
                          "run `mawforge verify`")
    return man


def index_from_dict(d: dict, where: str) -> ExpertIndex:
    try:
        files = tuple(SourceFile.from_dict(f, "source file")
                      for f in _list(d.get("source_files", []), "source_files"))
        layers = tuple(LayerBlocks.from_dict(x, d["format_version"], len(files))
                       for x in _list(d.get("layers"), "layers"))
        if [lb.layer for lb in layers] != list(range(len(layers))):
            raise FormatError("layers must be listed in order 0, 1, 2, ...")
        return ExpertIndex(_alignment(d.get("alignment")), layers, files)
    except FormatError as e:
        raise FormatError(f"{where}: {e}") from None


def read_index(pack: Path) -> ExpertIndex:
    return index_from_dict(load_json(Path(pack) / INDEX), f"{pack}/{INDEX}")


def compute_pack_digest(config: dict, common: tuple[TensorRecord, ...], common_digests: dict,
                        index: ExpertIndex, version: int = FORMAT_VERSION, alignment: int = 0,
                        layout: str = "", tokenizer_digests: dict | None = None) -> str:
    """The pack's content identity. Format 1: config, common digests, block digests, common
    records. Format 2 adds each layer's template digest and block offsets, the alignment, the
    layout and the tokenizer files' digests, so no edit of what the runtime reads passes verify."""
    pd = xxhash.xxh3_128()
    pd.update(json.dumps(config, sort_keys=True).encode())
    pd.update(json.dumps(common_digests, sort_keys=True).encode())
    for lb in index.layers:
        pd.update("".join(lb.digests).encode())
    pd.update(json.dumps([t.to_dict() for t in common]).encode())
    if version >= 2:
        pd.update(canonical({"alignment": alignment, "layout": layout, "tokenizer": tokenizer_digests or {},
                             "layers": [[lb.template_digest(), list(lb.offsets)] for lb in index.layers]}))
        if index.in_place:       # where the blocks are read from, so no edit of it passes verify
            pd.update(canonical({"files": [f.to_dict() for f in index.files],
                                 "sources": [[r.to_dict() for r in lb.sources] for lb in index.layers]}))
    return pd.hexdigest()
