"""Hugging Face directory reader: config.json plus one or many safetensors shards.

Only headers are read: each safetensors file starts with an 8-byte little-endian header
length and a JSON table of dtype, shape and byte offsets relative to the data section.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from gguf import GGMLQuantizationType as QT

from mawforge.errors import FormatError, UnsupportedError
from mawforge.formats import names
from mawforge.formats.config import from_hf_config
from mawforge.formats.source import ExpertTensor, Source, TensorInfo

DTYPES = {"F32": QT.F32, "F16": QT.F16, "BF16": QT.BF16}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja", "chat_template.json")


def read_safetensors_header(path: Path) -> list[tuple[str, str, tuple[int, ...], int, int]]:
    """(name, dtype, shape, absolute offset, nbytes) of every tensor in one shard."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise FormatError(f"{path.name}: truncated safetensors file ({size} bytes)")
        n = struct.unpack("<Q", head)[0]
        if n > min(size - 8, 1 << 28):
            raise FormatError(f"{path.name}: malformed safetensors header (length {n}, file {size})")
        try:
            table = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise FormatError(f"{path.name}: malformed safetensors header (not JSON)") from None
    if not isinstance(table, dict):
        raise FormatError(f"{path.name}: malformed safetensors header")
    base = 8 + n
    out = []
    for name, info in table.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (a, b) = info["dtype"], tuple(int(s) for s in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise FormatError(f"{path.name}: malformed entry for {name}") from None
        if base + b > size:
            raise FormatError(f"{path.name} is truncated: {name} ends at byte {base + b}, file has {size}")
        out.append((name, dtype, shape, base + a, b - a))
    return out


def _shards(d: Path) -> list[Path]:
    index = d / "model.safetensors.index.json"
    if index.exists():
        try:
            wm = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError):
            raise FormatError(f"{index}: malformed safetensors index") from None
        files = sorted({d / f for f in wm.values()})
    else:
        files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FormatError(f"{d}: no safetensors files")
    for f in files:
        if not f.exists():
            raise FormatError(f"{d}: shard {f.name} named in the index is missing")
    return files


def open_hf(d: Path) -> Source:
    cfg_path = d / "config.json"
    if not cfg_path.exists():
        raise FormatError(f"{d}: no config.json (not a Hugging Face model directory)")
    try:
        hf_cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise FormatError(f"{cfg_path}: malformed JSON ({e.msg})") from None
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
            if en is not None and en.expert is None:
                e_count, n_rows, k = shape if len(shape) == 3 else (shape[0], 1, shape[-1])   # [E, X] biases
                per = nbytes // e_count
                experts[(en.layer, en.kind)] = ExpertTensor(
                    en.layer, en.kind, qt, (n_rows, k), tuple((f, off + e * per, per) for e in range(e_count)))
            elif en is not None:
                per_expert.setdefault((en.layer, en.kind), {})[en.expert] = TensorInfo(name, qt, shape, f, off, nbytes)
            else:
                canon = names.hf_common(name, cfg.arch)
                if canon is None:
                    continue   # rotary caches and other buffers the runtime recomputes
                common[canon] = TensorInfo(canon, qt, shape, f, off, nbytes)
    for (layer, kind), by_e in per_expert.items():
        ts = [by_e[e] for e in sorted(by_e)]
        experts[(layer, kind)] = ExpertTensor(layer, kind, ts[0].qtype, ts[0].shape,
                                              tuple((t.path, t.offset, t.nbytes) for t in ts))
    if cfg.tie_embeddings:
        common.pop("output.weight", None)
    elif "output.weight" not in common:
        raise FormatError(f"{d}: config does not tie embeddings but there is no lm_head.weight")
    extra = [d / n for n in TOKENIZER_FILES if (d / n).exists()]
    return Source("hf", d, cfg, hf_cfg, common, experts, files=files, extra_files=extra)
