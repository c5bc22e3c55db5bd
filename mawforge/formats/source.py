"""Read-only views of a source model (GGUF file or HF safetensors directory).

A Source never loads a model: it holds metadata, the normalized config and, for every
tensor, where its bytes lie (file, absolute offset, length). Routed experts are exposed
per (layer, kind) with one contiguous byte range per expert, whatever the source layout
(a GGUF 3-D tensor, an HF fused 3-D parameter, or one HF tensor per expert).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from gguf import GGMLQuantizationType as QT
from gguf import GGML_QUANT_SIZES

from mawforge.errors import FormatError
from mawforge.formats.config import ModelConfig

EXPERT_KINDS = ("gate", "up", "down", "gate_up", "gate_up_t", "down_t",
                "gate_bias", "up_bias", "down_bias", "gate_up_bias")
# The tensor sets one expert block may hold. "_t" kinds are stored input-major (x @ W, HF
# GPT-OSS); biases travel in the block with their expert (GPT-OSS).
EXPERT_SETS = (
    ("gate", "up", "down"), ("down", "gate_up"),
    ("gate", "up", "down", "gate_bias", "up_bias", "down_bias"),
    ("gate_up_t", "down_t", "down_bias", "gate_up_bias"),
    ("gate_up_t", "down_t"),      # HF Llama 4
)


# Which axis of a per-expert [N, K] tensor is the model's hidden size (inputs of gate/up, output of down).
_HIDDEN_AXIS = {"gate": 1, "up": 1, "gate_up": 1, "down": 0}


def row_bytes(qtype: QT, k: int) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    if k % block:
        raise FormatError(f"row length {k} is not a multiple of the {qtype.name} block size {block}")
    return k // block * size


@dataclass(frozen=True)
class TensorInfo:
    name: str                  # canonical (llama.cpp) name, e.g. blk.0.attn_q.weight
    qtype: QT
    shape: tuple[int, ...]     # numpy order: outermost first, last = row length
    path: Path
    offset: int                # absolute byte offset in path
    nbytes: int

    def __post_init__(self) -> None:
        n_rows = 1
        for s in self.shape[:-1]:
            n_rows *= s
        want = n_rows * row_bytes(self.qtype, self.shape[-1])
        if want != self.nbytes:
            raise FormatError(f"{self.name}: {self.nbytes} bytes stored, {want} expected "
                              f"for {self.qtype.name} {list(self.shape)}")


@dataclass(frozen=True)
class ExpertTensor:
    """One kind (gate/up/down/gate_up) of one layer's routed experts."""
    layer: int
    kind: str
    qtype: QT
    shape: tuple[int, int]                           # per expert: (N rows, K row length)
    pieces: tuple[tuple[Path, int, int], ...]        # per expert: (path, offset, nbytes)

    def __post_init__(self) -> None:
        if self.kind not in EXPERT_KINDS:
            raise FormatError(f"unknown expert tensor kind {self.kind!r}")
        want = self.shape[0] * row_bytes(self.qtype, self.shape[1])
        for e, (_, _, n) in enumerate(self.pieces):
            if n != want:
                raise FormatError(f"layer {self.layer} expert {e} {self.kind}: {n} bytes, {want} expected")

    @property
    def expert_nbytes(self) -> int:
        return self.pieces[0][2] if self.pieces else 0


@dataclass
class Source:
    kind: str                                       # "gguf" or "hf"
    path: Path
    config: ModelConfig
    metadata: dict                                   # GGUF key/values, or HF config.json
    common: dict[str, TensorInfo]
    experts: dict[tuple[int, str], ExpertTensor]
    files: list[Path] = field(default_factory=list)  # every file whose bytes are read
    extra_files: list[Path] = field(default_factory=list)  # tokenizer files to copy (HF)

    def identity(self) -> dict:
        """Path, total size and mtime of the source files (the digest is computed while packing)."""
        size = sum(os.path.getsize(f) for f in self.files)
        mtime = max(os.path.getmtime(f) for f in self.files)
        return {"kind": self.kind, "path": str(self.path.resolve()), "size": size,
                "mtime": mtime, "files": [f.name for f in self.files]}

    def expert_kinds(self, layer: int) -> list[str]:
        return [k for k in EXPERT_KINDS if (layer, k) in self.experts]

    def fold_extra_layers(self) -> None:
        """Routed experts of layers past n_layers (the MTP blocks of Qwen3.5 and DeepSeek-V3)
        become common tensors: one 3-D tensor when the experts are contiguous, else one tensor
        per expert. An MTP layer's own embedding and output head (GGUF nextn.embed_tokens,
        nextn.shared_head_head) repeat the model's (DeepSeek-V3 shares them) and are dropped."""
        for name in [n for n in self.common
                     if n.endswith(("nextn.embed_tokens.weight", "nextn.shared_head_head.weight"))]:
            del self.common[name]
        for (layer, kind) in [k for k in self.experts if k[0] >= self.config.n_layers]:
            t = self.experts.pop((layer, kind))
            (path, off, n), per = t.pieces[0], t.expert_nbytes
            if all(p == path and o == off + e * per for e, (p, o, _) in enumerate(t.pieces)):
                name = f"blk.{layer}.ffn_{kind}_exps.weight"
                self.common[name] = TensorInfo(name, t.qtype, (len(t.pieces), *t.shape), path, off, per * len(t.pieces))
            else:
                for e, (p, o, n) in enumerate(t.pieces):
                    name = f"blk.{layer}.ffn_{kind}.{e}.weight"
                    self.common[name] = TensorInfo(name, t.qtype, t.shape, p, o, n)

    def validate(self) -> None:
        cfg = self.config
        dense = set(cfg.args.dense_layers)
        for layer in range(cfg.n_layers):
            kinds = self.expert_kinds(layer)
            if layer in dense:
                if kinds:
                    raise FormatError(f"layer {layer} is dense but has routed expert tensors {kinds}")
                continue
            if tuple(sorted(kinds)) not in {tuple(sorted(s)) for s in EXPERT_SETS}:
                raise FormatError(f"layer {layer}: routed expert tensors incomplete (found {kinds})")
            for k in kinds:
                t = self.experts[(layer, k)]
                if len(t.pieces) != cfg.n_experts:
                    raise FormatError(f"layer {layer} {k}: {len(t.pieces)} experts, config says {cfg.n_experts}")
                axis = _HIDDEN_AXIS.get(k)
                if axis is not None and t.shape[axis] != cfg.hidden:
                    raise FormatError(f"layer {layer} {k} experts have shape {list(t.shape)}; "
                                      f"the hidden size is {cfg.hidden}")
        for need in ("token_embd.weight", "output_norm.weight"):
            if need not in self.common:
                raise FormatError(f"model has no {need} tensor")
        from mawforge.formats.required import check_required
        check_required(cfg, self.common)
        for path, size in ((p, os.path.getsize(p)) for p in self.files):
            for t in self.common.values():
                if t.path == path and t.offset + t.nbytes > size:
                    raise FormatError(f"{path.name} is truncated: {t.name} ends at byte "
                                      f"{t.offset + t.nbytes}, file has {size}")
            for t in self.experts.values():
                for (p, off, n) in t.pieces:
                    if p == path and off + n > size:
                        raise FormatError(f"{path.name} is truncated: layer {t.layer} {t.kind} experts "
                                          f"end at byte {off + n}, file has {size}")


def open_source(path: str | os.PathLike) -> Source:
    """Open a GGUF file (or a shard set: any shard, or the directory that holds it) or an HF
    directory; one-line FormatError on anything malformed."""
    p = Path(path)
    if not p.exists():
        raise FormatError(f"{p}: no such file or directory")
    try:
        if p.is_dir() and not (p / "config.json").exists() and any(p.glob("*.gguf")):
            from mawforge.formats.gguf import open_gguf     # a directory of GGUF shards
            src = open_gguf(p)
        elif p.is_dir():
            from mawforge.formats.hf import open_hf
            src = open_hf(p)
        elif p.is_file():
            from mawforge.formats.gguf import open_gguf
            src = open_gguf(p)
        else:
            raise FormatError(f"{p}: not a regular file or a directory")
    except OSError as e:
        raise FormatError(f"{p}: cannot read {e.filename or ''} ({e.strerror or e})") from None
    src.fold_extra_layers()
    src.validate()
    return src
