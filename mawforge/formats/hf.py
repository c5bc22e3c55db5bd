"""Hugging Face directory reader: config.json plus one or many safetensors shards.

Only headers are read: each safetensors file starts with an 8-byte little-endian header
length and a JSON table of dtype, shape and byte offsets relative to the data section.
"""
from __future__ import annotations

import os
import struct
from pathlib import Path

from gguf import GGMLQuantizationType as QT

from mawforge.errors import FormatError, UnsupportedError
from mawforge.formats import jsonio, names
from mawforge.formats.config import from_hf_config
from mawforge.formats.gguf import _no_overlap
from mawforge.formats.source import ExpertTensor, Source, TensorInfo

DTYPES = {"F32": QT.F32, "F16": QT.F16, "BF16": QT.BF16}
# Bytes per element of every safetensors dtype, to check each entry's size against its shape.
ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8,
              "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja", "chat_template.json")


def read_safetensors_header(path: Path) -> list[tuple[str, str, tuple[int, ...], int, int]]:
    """(name, dtype, shape, absolute offset, nbytes) of every tensor in one shard. Every entry is
    checked: a string dtype, a list of non-negative integer dims, integer offsets inside the data
    section that match the shape and dtype, and no two tensors sharing bytes."""
    if not path.is_file():
        raise FormatError(f"{path}: not a file")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise FormatError(f"{path.name}: truncated safetensors file ({size} bytes)")
        n = struct.unpack("<Q", head)[0]
        if n > min(size - 8, 1 << 28):
            raise FormatError(f"{path.name}: malformed safetensors header (length {n}, file {size})")
        table = jsonio.loads(f.read(n), f"{path.name}: safetensors header")
    if not isinstance(table, dict):
        raise FormatError(f"{path.name}: malformed safetensors header (not an object)")
    base = 8 + n
    out = []
    for name, info in table.items():
        if name == "__metadata__":
            continue
        dtype, shape, a, b = _entry(path.name, name, info)
        if base + b > size:
            raise FormatError(f"{path.name} is truncated: {name} ends at byte {base + b}, file has {size}")
        out.append((name, dtype, shape, base + a, b - a))
    _no_overlap(path.name, [(off, nb, name) for name, _, _, off, nb in out if nb])
    return out


def _entry(fname: str, name: str, info) -> tuple[str, tuple[int, ...], int, int]:
    def bad(why: str) -> FormatError:
        return FormatError(f"{fname}: malformed entry for {name} ({why})")
    if not isinstance(info, dict):
        raise bad("not an object")
    dtype, shape, offs = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str):
        raise bad(f"dtype {dtype!r}")
    if not isinstance(shape, list) or len(shape) > 8 or not all(_uint(s) for s in shape):
        raise bad(f"shape {shape!r}")
    if not isinstance(offs, list) or len(offs) != 2 or not all(_uint(o) for o in offs) or offs[0] > offs[1]:
        raise bad(f"data_offsets {offs!r}")
    n = 1
    for s in shape:
        n *= s
    if dtype in ITEM_BYTES and n * ITEM_BYTES[dtype] != offs[1] - offs[0]:
        raise bad(f"{offs[1] - offs[0]} bytes for {dtype} shape {shape}")
    return dtype, tuple(shape), offs[0], offs[1]


def _uint(v) -> bool:
    return type(v) is int and 0 <= v < 1 << 62


def _shards(d: Path) -> list[Path]:
    index = d / "model.safetensors.index.json"
    if index.exists():
        wm = jsonio.load_file(index).get("weight_map")
        if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
            raise FormatError(f"{index}: weight_map must map tensor names to shard file names")
        for f in set(wm.values()):     # shards are plain names in the model directory, never paths
            if Path(f).name != f or f in (".", ".."):
                raise FormatError(f"{index}: shard {f[:100]!r} lies outside the model directory")
        files = sorted({d / f for f in wm.values()})
    else:
        files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FormatError(f"{d}: no safetensors files")
    for f in files:
        if not f.is_file():
            raise FormatError(f"{d}: shard {f.name} named in the index is missing or not a file")
    return files


def open_hf(d: Path) -> Source:
    cfg_path = d / "config.json"
    if (d / "manifest.json").exists() and (d / "experts.index").exists():
        raise FormatError(f"{d} is a MawForge pack, not a source model (GGUF file or HF directory)")
    if not cfg_path.exists():
        raise FormatError(f"{d}: no config.json (not a Hugging Face model directory)")
    hf_cfg = jsonio.load_file(cfg_path)
    cfg = from_hf_config(hf_cfg)
    files = _shards(d)
    common: dict[str, TensorInfo] = {}
    per_expert: dict[tuple[int, str], dict[int, TensorInfo]] = {}
    experts: dict[tuple[int, str], ExpertTensor] = {}
    for f in files:
        for raw_name, dtype, shape, off, nbytes in read_safetensors_header(f):
            name = names.hf_mtp(raw_name, cfg.n_layers)
            if dtype not in DTYPES and name.endswith(("_blocks", "_scales")):
                raise UnsupportedError(f"{f.name}: {name} is MXFP4 (blocks + scales); convert the model to GGUF "
                                       "with llama.cpp, whose MXFP4 experts MawForge packs byte-exact")
            if dtype not in DTYPES:
                raise UnsupportedError(f"{f.name}: tensor {name} has dtype {dtype}; "
                                       f"supported: {', '.join(DTYPES)}")
            qt = DTYPES[dtype]
            en = names.hf_expert(name, cfg.arch)
            if en is not None and (not shape or 0 in shape):
                raise FormatError(f"{f.name}: expert tensor {name} has shape {list(shape)}")
            if en is not None and en.expert is None:
                if len(shape) not in (2, 3):
                    raise FormatError(f"{f.name}: fused expert tensor {name} is not 3-D: {list(shape)}")
                e_count, n_rows, k = shape if len(shape) == 3 else (shape[0], 1, shape[-1])   # [E, X] biases
                per = nbytes // e_count
                experts[(en.layer, en.kind)] = ExpertTensor(
                    en.layer, en.kind, qt, (n_rows, k), tuple((f, off + e * per, per) for e in range(e_count)))
            elif en is not None:
                if len(shape) != 2 and not en.kind.endswith("_bias"):
                    raise FormatError(f"{f.name}: expert tensor {name} is not 2-D: {list(shape)}")
                per_expert.setdefault((en.layer, en.kind), {})[en.expert] = TensorInfo(name, qt, shape, f, off, nbytes)
            else:
                canon = names.hf_common(name, cfg.arch)
                if canon is None:
                    continue   # rotary caches and other buffers the runtime recomputes
                if not shape or 0 in shape:
                    raise FormatError(f"{f.name}: tensor {name} has shape {list(shape)}")
                if canon in common:
                    raise FormatError(f"{d}: tensor {name} appears twice")
                common[canon] = TensorInfo(canon, qt, shape, f, off, nbytes)
    for (layer, kind), by_e in per_expert.items():
        if sorted(by_e) != list(range(len(by_e))):
            raise FormatError(f"{d}: layer {layer} {kind} experts are not numbered 0..{len(by_e) - 1}")
        ts = [by_e[e] for e in sorted(by_e)]
        experts[(layer, kind)] = ExpertTensor(layer, kind, ts[0].qtype, ts[0].shape,
                                              tuple((t.path, t.offset, t.nbytes) for t in ts))
    if cfg.tie_embeddings:
        common.pop("output.weight", None)
    elif "output.weight" not in common:
        raise FormatError(f"{d}: config does not tie embeddings but there is no lm_head.weight")
    extra = [d / n for n in TOKENIZER_FILES if (d / n).exists()]
    for f in extra:            # copied into the pack and read by the runtime: refuse damage now
        if not f.is_file():
            raise FormatError(f"{f}: not a regular file")
        if f.suffix == ".json":
            jsonio.load_file(f)
    return Source("hf", d, cfg, hf_cfg, common, experts, files=files, extra_files=extra)
