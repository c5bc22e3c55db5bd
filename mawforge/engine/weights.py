"""Resident common tensors: common.bin read once into one page-aligned buffer, viewed in place.

Small tensors the math wants in float (norms, routers, biases, the shared-expert gate) are
also kept as float32 copies; their bytes count in `resident_bytes`. With stream_embeddings the
token-embedding rows stay on disk and only the rows a request needs are read.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
from gguf import GGMLQuantizationType as QT

from mawforge.byte_rules import is_dense
from mawforge.cache.store import aligned_buffer
from mawforge.errors import IntegrityError
from mawforge.codecs import quants
from mawforge.formats.source import row_bytes
from mawforge.kernels import embedding_rows
from mawforge.pack.manifest import COMMON, Manifest, TensorRecord, digest

EMBEDDING, OUTPUT = "token_embd.weight", "output.weight"


def _as2d(shape) -> tuple[int, int]:
    n = 1
    for s in shape[:-1]:
        n *= s
    return n, shape[-1]


class CommonWeights:
    def __init__(self, pack: Path, man: Manifest, device: torch.device, stream_embeddings: bool = False,
                 check_digests: bool = True):
        self.device, self.stream = device, stream_embeddings
        self.records = {r.name: r for r in man.common}
        path = Path(pack) / COMMON
        size = os.path.getsize(path)
        self._mm, host = aligned_buffer(size)
        emb = self.records[EMBEDDING]
        with open(path, "rb", buffering=0) as f:
            pos = 0
            for r in sorted(man.common, key=lambda r: r.parts[0].offset):
                if stream_embeddings and r.name == EMBEDDING:
                    continue
                start, end = r.parts[0].offset, r.parts[-1].offset + r.parts[-1].nbytes
                f.seek(start)
                f.readinto(memoryview(self._mm)[start:end])
                if check_digests and digest(b"".join(bytes(memoryview(self._mm)[p.offset:p.offset + p.nbytes])
                                                     for p in r.parts)) != man.common_digests.get(r.name):
                    raise IntegrityError(f"common tensor {r.name} is damaged (digest mismatch); run `mawforge verify`")
                pos = max(pos, end)
        self.buf = host if device.type == "cpu" else host.to(device)
        self.resident_bytes = size - (emb.nbytes if stream_embeddings else 0)
        self._packed: dict[str, quants.PackedWeight] = {}
        self._dense: dict[str, torch.Tensor] = {}
        for name, r in self.records.items():
            if stream_embeddings and name == EMBEDDING:
                continue
            w = self._view(r)
            self._packed[name] = w
            if is_dense(name):
                d = quants.dequantize(w).reshape(r.shape).float().to(device)
                self._dense[name] = d
                self.resident_bytes += d.nbytes
        self.emb_qtype = QT[emb.qtype]
        self.emb_row_bytes = row_bytes(self.emb_qtype, emb.shape[-1])
        self.emb_offset, self.hidden = emb.parts[0].offset, emb.shape[-1]
        self._emb_fd = os.open(path, os.O_RDONLY) if stream_embeddings else None
        self.embedding_bytes_read = 0

    def _view(self, r: TensorRecord) -> quants.PackedWeight:
        specs = [quants.PartSpec(p.name, p.dtype, p.shape) for p in r.parts]
        return quants.get_codec(r.codec).view(self.buf, [p.offset for p in r.parts], specs,
                                              QT[r.qtype], _as2d(r.shape))

    def has(self, name: str) -> bool:
        return name in self.records

    def packed(self, name: str) -> quants.PackedWeight:
        return self._packed[name]

    def dense(self, name: str) -> torch.Tensor:
        return self._dense[name]

    def maybe_dense(self, name: str) -> torch.Tensor | None:
        return self._dense.get(name)

    def bind(self, name: str) -> torch.Tensor | quants.PackedWeight:
        """The tensor a model block computes with: its float32 copy if kept dense, else packed."""
        return self._dense.get(name) if is_dense(name) else self._packed[name]

    def head(self) -> quants.PackedWeight:
        return self._packed.get(OUTPUT) or self._packed[EMBEDDING]

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [T] -> [T, C] float32."""
        rb = self.emb_row_bytes
        if not self.stream:
            table = self.buf[self.emb_offset:self.emb_offset + rb * (self.records[EMBEDDING].shape[0])].view(-1, rb)
            rows = table.index_select(0, tokens.to(self.buf.device))
            return embedding_rows(rows, self.emb_qtype, self.hidden).float().to(self.device)
        uniq, inv = torch.unique(tokens.cpu(), return_inverse=True)
        raw = bytearray(rb * len(uniq))
        for i, t in enumerate(uniq.tolist()):
            raw[i * rb:(i + 1) * rb] = os.pread(self._emb_fd, rb, self.emb_offset + t * rb)
        self.embedding_bytes_read += len(raw)
        rows = torch.frombuffer(raw, dtype=torch.uint8).view(len(uniq), rb)
        return embedding_rows(rows, self.emb_qtype, self.hidden).float()[inv].to(self.device)

    def close(self) -> None:
        if self._emb_fd is not None:
            os.close(self._emb_fd)
