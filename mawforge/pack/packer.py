"""Streaming packer: source model -> split pack, with bounded memory.

Memory bound: one reader thread keeps at most QUEUE_BATCHES + 2 batches of BATCH_BYTES
source bytes in flight, the writer stages 32 MiB, and common tensors are copied in CHUNK
slices (a transcoded common tensor is encoded whole, so only tensors up to
TRANSCODE_COMMON_MAX source bytes are transcoded). Peak memory therefore depends on the
largest expert block and those caps, never on the model's size.
Atomic: everything is written into a hidden temp directory next to the target and renamed
into place only after every file is fsynced; any error or Ctrl-C removes the temp dir.
"""
from __future__ import annotations

import errno
import json
import os
import queue
import shutil
import sys
import threading
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import xxhash

from mawforge import __version__
from mawforge.errors import FormatError, MawError
from mawforge.codecs import quants
from mawforge.formats.source import ExpertTensor, Source, TensorInfo, open_source
from mawforge.pack.directio import _ZEROS, Reader, Writer
from mawforge.pack.output import check_output, fsync_dir, replace_dir
from mawforge.pack.inplace import InPlaceRefused, check_in_place, in_place_index  # noqa: F401  (re-exported)
from mawforge.pack.manifest import (COMMON, EXPERTS, INDEX, MANIFEST, PAGE, ExpertIndex, LayerBlocks, Manifest,
                                    Part, TensorRecord, compute_pack_digest, digest, file_digest)

CHUNK = 32 << 20
BATCH_BYTES = 16 << 20             # source bytes of experts read per batch (per layer)
QUEUE_BATCHES = 3
PART_ALIGN = 64                    # typed views inside a block start on 64-byte boundaries
COMMON_ALIGN = 4096
TRANSCODE_COMMON_MAX = 64 << 20
EMBEDDING = "token_embd.weight"    # row-gathered (and optionally streamed): always byte-exact


BYTE_EXACT = frozenset({"f32", "f16", "bf16", "ggml"})
_TRANSFORM_NOTES = {
    "int4_g32": "4-bit values regrouped into torch's CPU int4pack layout (groups of 32) with bf16 "
                "scale and zero per group: scale = d*sc, zero = 8*d*sc - dmin*m (Q4_K); values equal "
                "the source up to bf16 rounding of scale and zero",
}


def _byte_exact(codec: str) -> bool:
    return codec in BYTE_EXACT


def _round_up(n: int, a: int) -> int:
    return -(-n // a) * a


def _as2d(shape: tuple[int, ...]) -> tuple[int, int]:
    n = 1
    for s in shape[:-1]:
        n *= s
    return n, shape[-1]


def _place(codec, qtype, shape, base: int, align: int, name: str) -> tuple[TensorRecord, int]:
    parts, off = [], base
    for spec in codec.parts(qtype, _as2d(shape)):
        off = _round_up(off, align)
        nb = int(np.prod(spec.shape)) * np.dtype(_np_dtype(spec.dtype)).itemsize
        parts.append(Part(spec.name, spec.dtype, tuple(spec.shape), off, nb))
        off += nb
    return TensorRecord(name, qtype.name, codec.name, tuple(shape), tuple(parts)), off


def _np_dtype(name: str) -> str:
    return "uint16" if name == "bfloat16" else name


@dataclass
class _Plan:
    common: list[tuple[TensorInfo, TensorRecord]]
    layers: list[tuple[list[ExpertTensor], LayerBlocks]]   # digests filled in while writing
    common_bytes: int
    experts_bytes: int


def plan_pack(src: Source, alignment: int, layout: str, in_place: bool = False) -> _Plan:
    """In place, every expert tensor is one part in a page of its own, a page after the previous
    part's last (its bytes are read from the source into the slot there as a page-aligned superset,
    which never reaches the next part): at the offset in the page its bytes have in the file where
    every expert's agree, else on the page boundary (the reader moves them down). No block has an
    offset in experts.pack."""
    if alignment < 4096 or alignment & (alignment - 1):
        raise FormatError(f"alignment must be a power of two of at least 4096, got {alignment}")
    part_align = PAGE if in_place else PART_ALIGN
    common, off = [], 0
    for name in sorted(src.common):
        t = src.common[name]
        big = t.nbytes > TRANSCODE_COMMON_MAX
        mode = "exact" if (name == EMBEDDING or big or len(t.shape) == 1) else layout
        codec = quants.choose_codec(t.qtype, mode, _as2d(t.shape))
        rec, end = _place(codec, t.qtype, t.shape, _round_up(off, COMMON_ALIGN), COMMON_ALIGN, name)
        common.append((t, rec))
        off = end
    layers, base = [], 0
    for layer in range(src.config.n_layers):
        ets = [src.experts[(layer, k)] for k in src.expert_kinds(layer)]
        recs, end = [], 0
        for et in ets:
            gap = PAGE if in_place and recs else 0    # in place: a page between tensors (reader.c's segments)
            rec, end = _place(quants.choose_codec(et.qtype, layout, et.shape), et.qtype, et.shape, end + gap,
                              part_align, et.kind)
            if in_place:
                check_in_place(et, rec, _byte_exact(rec.codec))
                heads = {off % PAGE for _, off, _ in et.pieces}
                head = heads.pop() if len(heads) == 1 else 0    # every expert's bytes start alike in a page:
                if head and head % PART_ALIGN == 0:            # the part starts there too, read in place
                    p = rec.parts[0]                           # (64-byte aligned, as in a copied pack)
                    rec = replace(rec, parts=(replace(p, offset=p.offset + head),))
                    end += head
            recs.append(rec)
        stride = 0 if in_place else _round_up(end, alignment)
        n = len(ets[0].pieces) if ets else 0      # dense layers (DeepSeek's first_k_dense) have no experts
        offsets = tuple(base + e * stride for e in range(n))
        layers.append((ets, LayerBlocks(layer, end, tuple(recs), offsets, ("",) * n)))
        base += n * stride
    return _Plan(common, layers, off, base)


class _Progress:
    def __init__(self, total: int, enabled: bool):
        self.bar = None
        if enabled:
            from tqdm import tqdm
            self.bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024,
                            desc="pack", file=sys.stderr, dynamic_ncols=True)

    def update(self, n: int) -> None:
        if self.bar:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar:
            self.bar.close()


def _encode(rec: TensorRecord, raw: bytes, qtype, shape) -> list[np.ndarray]:
    codec = quants.get_codec(rec.codec)
    arrays = codec.encode(np.frombuffer(raw, dtype=np.uint8), qtype, _as2d(shape))
    for a, p in zip(arrays, rec.parts):
        if a.nbytes != p.nbytes:
            raise AssertionError(f"codec {rec.codec} wrote {a.nbytes} bytes for part {p.name}, planned {p.nbytes}")
    return arrays


def _contiguous(et: ExpertTensor, e0: int, e1: int) -> bool:
    p = et.pieces
    return all(p[e][0] == p[e0][0] and p[e][1] == p[e - 1][1] + p[e - 1][2] for e in range(e0 + 1, e1))


def _write_common(plan: _Plan, rd: Reader, out: Path, hasher, prog: _Progress) -> dict:
    digests = {}
    w = Writer(out)
    try:
        for t, rec in plan.common:
            h = xxhash.xxh3_128()
            if _byte_exact(rec.codec):
                w.pad_to(rec.parts[0].offset)
                for pos in range(0, t.nbytes, CHUNK):
                    buf, mv = rd.read(t.path, t.offset + pos, min(CHUNK, t.nbytes - pos))
                    hasher.update(mv)
                    h.update(mv)
                    w.write_at(w.end, mv)
                    prog.update(len(mv))
                    buf.release()
            else:
                buf, mv = rd.read(t.path, t.offset, t.nbytes)
                hasher.update(mv)
                for a, p in zip(_encode(rec, mv, t.qtype, t.shape), rec.parts):
                    data = memoryview(np.ascontiguousarray(a)).cast("B")
                    h.update(data)
                    w.write_at(p.offset, data)
                buf.release()
                prog.update(t.nbytes)
            digests[t.name] = h.hexdigest()
    except BaseException:
        w.abort()
        raise
    w.close(_round_up(max(plan.common_bytes, 1), COMMON_ALIGN))
    return digests


def _reader(plan: _Plan, rd: Reader, q: queue.Queue, stop: threading.Event) -> None:
    """Reads expert batches (up to BATCH_BYTES of source per batch, one read per kind where
    the experts lie back to back) and hands them to the writer."""
    def put(item) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

    try:
        for ets, lb in plan.layers:
            n_exp = len(lb.offsets)
            per = max(1, BATCH_BYTES // max(1, sum(et.expert_nbytes for et in ets)))
            for e0 in range(0, n_exp, per):
                e1 = min(n_exp, e0 + per)
                bufs, views = [], []
                for et in ets:
                    n = et.expert_nbytes
                    if _contiguous(et, e0, e1):
                        path, off, _ = et.pieces[e0]
                        buf, mv = rd.read(path, off, n * (e1 - e0))
                        bufs.append(buf)
                        views.append([mv[i * n:(i + 1) * n] for i in range(e1 - e0)])
                    else:
                        got = [rd.read(*et.pieces[e]) for e in range(e0, e1)]
                        bufs += [g[0] for g in got]
                        views.append([g[1] for g in got])
                if not put((lb.layer, e0, e1, views, bufs)):
                    return
        put(None)
    except BaseException as ex:   # hand the error to the writer thread
        put(ex)


def _write_experts(plan: _Plan, rd: Reader, out: Path | None, prog: _Progress) -> tuple[list[LayerBlocks], dict]:
    """Returns the layer records with digests, and per (layer, kind) source digests. With no
    `out` (an in-place pack) nothing is written: each block's digest covers its parts' bytes."""
    src_hash = {(lb.layer, et.kind): xxhash.xxh3_128() for ets, lb in plan.layers for et in ets}
    digests: dict[int, list[str]] = {lb.layer: [] for _, lb in plan.layers}
    q: queue.Queue = queue.Queue(maxsize=QUEUE_BATCHES)
    stop = threading.Event()
    th = threading.Thread(target=_reader, args=(plan, rd, q, stop), daemon=True)
    th.start()
    by_layer = {lb.layer: (ets, lb) for ets, lb in plan.layers}
    w = Writer(out) if out is not None else None
    try:
        while True:
            item = q.get()
            if item is None:
                break
            if isinstance(item, BaseException):
                raise item
            layer, e0, e1, views, bufs = item
            ets, lb = by_layer[layer]
            for i, e in enumerate(range(e0, e1)):
                h = xxhash.xxh3_128()
                base = lb.offsets[e]
                if w is None:
                    for et, raws in zip(ets, views):
                        src_hash[(layer, et.kind)].update(raws[i])
                        h.update(raws[i])
                        prog.update(len(raws[i]))
                    digests[layer].append(h.hexdigest())
                    continue
                w.pad_to(base)                      # the previous block's alignment padding
                for et, rec, raws in zip(ets, lb.tensors, views):
                    raw = raws[i]
                    src_hash[(layer, et.kind)].update(raw)
                    if _byte_exact(rec.codec):
                        parts = [(rec.parts[0], raw)]
                    else:
                        parts = [(p, memoryview(np.ascontiguousarray(a)).cast("B"))
                                 for a, p in zip(_encode(rec, raw, et.qtype, et.shape), rec.parts)]
                    for p, data in parts:
                        h.update(_ZEROS[:w.pad_to(base + p.offset)])   # gap between parts
                        w.write_at(base + p.offset, data)
                        h.update(data)
                    prog.update(len(raw))
                digests[layer].append(h.hexdigest())
            for b in bufs:
                b.release()
    except BaseException:
        if w is not None:
            w.abort()
        raise
    finally:
        stop.set()
        th.join()
    if w is not None:
        w.close(max(plan.experts_bytes, 1))
    layers = [LayerBlocks(lb.layer, lb.block_nbytes, lb.tensors, lb.offsets, tuple(digests[lb.layer]))
              for _, lb in plan.layers]
    return layers, {k: h.hexdigest() for k, h in src_hash.items()}


def _tokenizer(src: Source, tmp: Path) -> dict:
    if src.kind == "gguf":
        # general.name/architecture too: llama.cpp sets some tokens' strip attributes by model name
        tok = {k: v for k, v in src.metadata.items()
               if k.startswith("tokenizer.") or k in ("general.name", "general.architecture")}
        (tmp / "tokenizer.gguf.json").write_text(json.dumps(tok))
        files = ["tokenizer.gguf.json"]
    else:
        for f in src.extra_files:
            shutil.copyfile(f, tmp / f.name)
        files = [f.name for f in src.extra_files]
    return {"kind": src.kind, "files": files, "digests": {f: file_digest(tmp / f) for f in files}}


def pack(source: str | os.PathLike, out: str | os.PathLike, *, alignment: int = 65536,
         layout: str = "exact", force: bool = False, progress: bool = True, in_place: bool = False) -> Manifest:
    """in_place: write no experts.pack; the index points at the expert bytes in the source GGUF
    files (which must stay where and as they are; `verify` and every first read check them)."""
    out = Path(out)
    layout = quants.pack_layout(layout)
    check_output(out, force)
    src = open_source(source)
    if in_place and src.kind != "gguf":
        raise InPlaceRefused(f"{source}: --in-place packs a GGUF file or shard set (a Hugging Face directory's "
                          "experts are stored per expert, in another order)")
    plan = plan_pack(src, alignment, layout, in_place)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    files = Reader(src.files)
    total = sum(t.nbytes for t, _ in plan.common) + sum(
        et.expert_nbytes * len(et.pieces) for ets, _ in plan.layers for et in ets)
    prog = _Progress(total, progress)
    try:
        meta_hash = xxhash.xxh3_128(json.dumps(src.metadata, sort_keys=True, default=str).encode())
        common_hasher = xxhash.xxh3_128()
        common_digests = _write_common(plan, files, tmp / COMMON, common_hasher, prog)
        layers, expert_src = _write_experts(plan, files, None if in_place else tmp / EXPERTS, prog)
        index = (in_place_index(plan.layers, src, layers, expert_src, out, alignment) if in_place
                 else ExpertIndex(alignment, tuple(layers)))
        index_json = index.to_json()
        (tmp / INDEX).write_text(index_json)
        tok = _tokenizer(src, tmp)
        source_digest = xxhash.xxh3_128_hexdigest(
            (meta_hash.hexdigest() + common_hasher.hexdigest()
             + "".join(expert_src[k] for k in sorted(expert_src))).encode())
        manifest = _manifest(src, plan, index, common_digests, tok, source_digest, alignment, layout,
                             digest(index_json.encode()))
        (tmp / MANIFEST).write_text(manifest.to_json())
        fsync_dir(tmp)
        replace_dir(tmp, out)
        return manifest
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise MawError(f"disk full while writing {out}; nothing was left behind") from None
        raise
    finally:
        prog.close()
        files.close()
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _manifest(src, plan, index, common_digests, tok, source_digest, alignment, layout, index_digest) -> Manifest:
    common = tuple(rec for _, rec in plan.common)
    transforms: dict[tuple[str, str], int] = {}
    for rec in common + tuple(t for lb in index.layers for t in lb.tensors):
        if not _byte_exact(rec.codec):
            transforms[(rec.qtype, rec.codec)] = transforms.get((rec.qtype, rec.codec), 0) + 1
    tf = tuple({"from": q, "to": c, "tensors": n, "note": _TRANSFORM_NOTES.get(c.split("_avx")[0], c)}
               for (q, c), n in sorted(transforms.items()))
    emb = next((rec.nbytes for rec in common if rec.name == EMBEDDING), 0)
    totals = {"common": sum(r.nbytes for r in common), "embedding": emb,
              "experts": index.total_bytes(), "expert_block_by_layer": index.block_bytes(),
              "expert_blocks": sum(len(lb.offsets) for lb in index.layers),
              "common_file": plan.common_bytes, "experts_file": plan.experts_bytes}
    pack_digest = compute_pack_digest(src.config.to_dict(), common, common_digests, index, alignment=alignment,
                                      layout=layout, tokenizer_digests=tok["digests"])
    ident = dict(src.identity(), digest=source_digest, digest_kind="xxh3-128 over metadata and every tensor's bytes",
                 in_place=index.in_place)
    return Manifest(src.config, ident, pack_digest, alignment, layout, tf, totals, common,
                    common_digests, {**tok, "created_by": f"mawforge {__version__}"}, index_digest=index_digest)
