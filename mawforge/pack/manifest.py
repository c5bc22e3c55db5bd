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
from mawforge.formats.config import ModelConfig

FORMAT = "mawforge-pack"
FORMAT_VERSION = 1
MANIFEST, COMMON, EXPERTS, INDEX = "manifest.json", "common.bin", "experts.pack", "experts.index"


def digest(data) -> str:
    """128-bit block digest (xxh3-128), hex."""
    return xxhash.xxh3_128_hexdigest(data)


@dataclass(frozen=True)
class Part:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int      # relative to the tensor's block (experts) or absolute (common.bin)
    nbytes: int

    @classmethod
    def from_dict(cls, d: dict) -> "Part":
        return cls(d["name"], d["dtype"], tuple(d["shape"]), int(d["offset"]), int(d["nbytes"]))


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
    def from_dict(cls, d: dict) -> "TensorRecord":
        return cls(d["name"], d["qtype"], d["codec"], tuple(d["shape"]),
                   tuple(Part.from_dict(p) for p in d["parts"]))


@dataclass(frozen=True)
class LayerBlocks:
    """All experts of one layer share a block template; each block has an offset and digest."""
    layer: int
    block_nbytes: int                     # logical bytes (padding excluded)
    tensors: tuple[TensorRecord, ...]     # part offsets relative to the block start
    offsets: tuple[int, ...]              # per expert, absolute in experts.pack
    digests: tuple[str, ...]              # per expert, xxh3-128 of the block's bytes

    def to_dict(self) -> dict:
        return {"layer": self.layer, "block_nbytes": self.block_nbytes,
                "tensors": [t.to_dict() for t in self.tensors],
                "blocks": [[o, d] for o, d in zip(self.offsets, self.digests)]}

    @classmethod
    def from_dict(cls, d: dict) -> "LayerBlocks":
        blocks = d["blocks"]
        return cls(int(d["layer"]), int(d["block_nbytes"]),
                   tuple(TensorRecord.from_dict(t) for t in d["tensors"]),
                   tuple(int(b[0]) for b in blocks), tuple(str(b[1]) for b in blocks))


@dataclass(frozen=True)
class ExpertIndex:
    alignment: int
    layers: tuple[LayerBlocks, ...]

    def block(self, layer: int, expert: int) -> tuple[int, int, str]:
        lb = self.layers[layer]
        return lb.offsets[expert], lb.block_nbytes, lb.digests[expert]

    def block_bytes(self) -> list[int]:
        return [lb.block_nbytes for lb in self.layers]

    def total_bytes(self) -> int:
        return sum(lb.block_nbytes * len(lb.offsets) for lb in self.layers)

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "format_version": FORMAT_VERSION,
                           "alignment": self.alignment,
                           "layers": [lb.to_dict() for lb in self.layers]}, separators=(",", ":"))


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
             "common_digests": self.common_digests, "tokenizer": self.tokenizer}
        return json.dumps(d, indent=1)


def _load_json(path: Path) -> dict:
    try:
        d = json.loads(path.read_text())
    except FileNotFoundError:
        raise FormatError(f"{path.parent}: not a MawForge pack (no {path.name})") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise FormatError(f"{path}: malformed JSON") from None
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise FormatError(f"{path}: not a MawForge pack file")
    if d.get("format_version") != FORMAT_VERSION:
        raise FormatError(f"{path}: pack format version {d.get('format_version')} "
                          f"(this MawForge reads {FORMAT_VERSION})")
    return d


def read_manifest(pack: Path) -> Manifest:
    d = _load_json(Path(pack) / MANIFEST)
    try:
        return Manifest(ModelConfig.from_dict(d["config"]), d["source"], d["pack_digest"],
                        int(d["alignment"]), d["layout"], tuple(d["transforms"]), d["bytes"],
                        tuple(TensorRecord.from_dict(t) for t in d["common"]), d["common_digests"],
                        d["tokenizer"])
    except (KeyError, TypeError, ValueError) as e:
        raise FormatError(f"{pack}/{MANIFEST}: missing or bad field ({e})") from None


def read_index(pack: Path) -> ExpertIndex:
    d = _load_json(Path(pack) / INDEX)
    try:
        return ExpertIndex(int(d["alignment"]), tuple(LayerBlocks.from_dict(x) for x in d["layers"]))
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise FormatError(f"{pack}/{INDEX}: missing or bad field ({e})") from None
