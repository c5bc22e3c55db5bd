"""Recompute every digest of a pack and name the damaged parts: blocks by layer and expert,
common tensors by name, and (format 2) the manifest, the index, each layer's block template
and the tokenizer files.

Every size and offset the JSON declares is checked against the file before anything is read,
and bytes are read in CHUNK-sized pieces, so a damaged index that claims a 2^40-byte block
costs one comparison, not an allocation.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from mawforge.errors import FormatError
from mawforge.pack.manifest import (COMMON, EXPERTS, INDEX, MANIFEST, compute_pack_digest, file_digest,
                                    index_from_dict, load_json, manifest_digest, manifest_from_dict)

CHUNK = 4 << 20      # the most verify ever holds of a file at once


@dataclass
class VerifyReport:
    pack: Path
    blocks_checked: int = 0
    common_checked: int = 0
    damaged_blocks: list[tuple[int, int]] = field(default_factory=list)   # (layer, expert)
    damaged_common: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)                     # missing/short files, JSON digests
    notes: list[str] = field(default_factory=list)                        # what could not be checked

    @property
    def ok(self) -> bool:
        return not (self.damaged_blocks or self.damaged_common or self.problems)

    def lines(self) -> list[str]:
        out = [f"{self.pack}: {self.blocks_checked} expert blocks, {self.common_checked} common tensors checked"]
        out += [f"DAMAGED expert block: layer {l} expert {e}" for l, e in self.damaged_blocks]
        out += [f"DAMAGED common tensor: {n}" for n in self.damaged_common]
        out += [f"PROBLEM: {p}" for p in self.problems]
        out += [f"NOTE: {n}" for n in self.notes]
        out.append("OK: every digest matches" if self.ok else
                   f"FAILED: {len(self.damaged_blocks)} damaged blocks, {len(self.damaged_common)} "
                   f"damaged common tensors, {len(self.problems)} other problems")
        return out


def verify(pack: str | os.PathLike, progress: bool = False) -> VerifyReport:
    """A report; raises FormatError only when the JSON cannot be read as a pack at all."""
    pack = Path(pack)
    raw_man, raw_index = load_json(pack / MANIFEST), load_json(pack / INDEX)
    man = manifest_from_dict(raw_man, f"{pack}/{MANIFEST}")
    index = index_from_dict(raw_index, f"{pack}/{INDEX}")
    rep = VerifyReport(pack)
    _check_json(pack, raw_man, man, index, rep)
    bar = None
    if progress:
        import sys

        from tqdm import tqdm
        bar = tqdm(total=index.total_bytes(), unit="B", unit_scale=True, desc="verify", file=sys.stderr)
    try:
        _check_common(pack, man, rep)
        _check_experts(pack, index, rep, bar, man.byte_totals.get("experts_file"))
    finally:
        if bar:
            bar.close()
    return rep


def _check_json(pack: Path, raw_man: dict, man, index, rep: VerifyReport) -> None:
    if len(index.layers) != man.config.n_layers:
        rep.problems.append(f"{INDEX} has {len(index.layers)} layers, the config {man.config.n_layers}")
    if index.alignment != man.alignment:
        rep.problems.append(f"{INDEX} alignment {index.alignment} differs from the manifest's {man.alignment}")
    if man.version < 2:
        rep.notes.append("format 1 pack: the manifest, index templates and tokenizer files carry no digest "
                         "and were not checked (repack to get format 2)")
    else:
        if raw_man.get("manifest_digest") != manifest_digest(raw_man):
            rep.problems.append(f"{MANIFEST} was edited (its manifest_digest does not match its contents)")
        if file_digest(pack / INDEX) != man.index_digest:
            rep.problems.append(f"{INDEX} does not match the index_digest in {MANIFEST}")
        for lb in index.layers:
            if lb.template_digest() != lb.tensors_digest:
                rep.problems.append(f"{INDEX} layer {lb.layer}: block template edited (tensors_digest mismatch)")
        tok = man.tokenizer.get("digests")
        if not isinstance(tok, dict):
            rep.problems.append(f"{MANIFEST}: tokenizer.digests missing")
            tok = {}
        for name, want in tok.items():
            path = pack / str(name)
            if Path(str(name)).name != name or not path.is_file():
                rep.problems.append(f"tokenizer file {name} is missing")
            elif file_digest(path) != want:
                rep.problems.append(f"tokenizer file {name} is damaged (digest mismatch)")
    want = compute_pack_digest(man.config.to_dict(), man.common, man.common_digests, index, man.version,
                               man.alignment, man.layout, man.tokenizer.get("digests"))
    if want != man.pack_digest:
        rep.problems.append("pack_digest does not match the manifest and index contents")


def _open(path: Path, rep: VerifyReport) -> tuple[int, int] | None:
    """(fd, size) of a pack data file, or None with the problem recorded."""
    if not path.exists():
        rep.problems.append(f"{path.name} is missing")
        return None
    if not path.is_file():
        rep.problems.append(f"{path.name} is not a regular file")
        return None
    fd = os.open(path, os.O_RDONLY)
    return fd, os.fstat(fd).st_size


def _hash_range(fd: int, off: int, n: int, h, bar=None) -> None:
    """Feeds bytes [off, off + n) into h, CHUNK at a time; the caller checked the range."""
    end = off + n
    while off < end:
        b = os.pread(fd, min(CHUNK, end - off), off)
        if not b:
            raise FormatError("file shrank while being verified")
        h.update(b)
        off += len(b)
        if bar:
            bar.update(len(b))


def _check_common(pack: Path, man, rep: VerifyReport) -> None:
    opened = _open(pack / COMMON, rep)
    if opened is None:
        return
    fd, size = opened
    _check_size(COMMON, size, man.byte_totals.get("common_file"), rep)
    try:
        for rec in man.common:
            rep.common_checked += 1
            bad = next((p for p in rec.parts if p.offset + p.nbytes > size), None)
            if bad is not None:
                rep.problems.append(f"{COMMON} is truncated inside {rec.name} ({bad.name} ends at "
                                    f"{bad.offset + bad.nbytes}, file has {size})")
                continue
            h = xxhash.xxh3_128()
            for p in rec.parts:
                _hash_range(fd, p.offset, p.nbytes, h)
            if h.hexdigest() != man.common_digests.get(rec.name):
                rep.damaged_common.append(rec.name)
    finally:
        os.close(fd)


def _check_size(name: str, size: int, declared, rep: VerifyReport) -> None:
    """The manifest's file sizes (packs write each file to exactly that size; the padding after
    the last block is not covered by a digest, so this is what notices it being cut)."""
    if type(declared) is int and size not in (declared, -(-declared // 4096) * 4096, 1 if declared == 0 else -1):
        rep.problems.append(f"{name} has {size} bytes, the manifest says {declared}")


class _Tee:
    """Feeds the same bytes to two hashers."""
    def __init__(self, a, b) -> None:
        self.a, self.b = a, b

    def update(self, data) -> None:
        self.a.update(data)
        self.b.update(data)


def _check_in_place(pack: Path, index, rep: VerifyReport, bar) -> None:
    """An in-place pack's blocks, read from its source files: each block's digest, and each
    tensor's over all its experts, so a change is named by tensor and file."""
    from mawforge.errors import IntegrityError
    from mawforge.pack.manifest import resolve_source
    fds: dict[int, tuple[int, int, Path]] = {}
    try:
        for i, f in enumerate(index.files):
            try:
                path = resolve_source(pack, f)
            except IntegrityError as e:
                rep.problems.append(str(e))
                continue
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            fds[i] = (fd, os.fstat(fd).st_size, path)
        for lb in index.layers:
            if any(r.file not in fds for r in lb.sources):
                rep.blocks_checked += len(lb.digests)
                rep.damaged_blocks += [(lb.layer, e) for e in range(len(lb.digests))]
                continue
            per_tensor = [xxhash.xxh3_128() for _ in lb.sources]
            for e, want in enumerate(lb.digests):
                rep.blocks_checked += 1
                h = xxhash.xxh3_128()
                for t, r, th in zip(lb.tensors, lb.sources, per_tensor):
                    fd, size, _ = fds[r.file]
                    n, off = t.parts[0].nbytes, r.offsets[e]
                    if off + n > size:
                        rep.problems.append(f"layer {lb.layer} expert {e}: {r.tensor} ends at {off + n}, past the "
                                            f"end of {fds[r.file][2].name}")
                        break
                    _hash_range(fd, off, n, _Tee(h, th), bar)
                if h.hexdigest() != want:
                    rep.damaged_blocks.append((lb.layer, e))
            for r, th in zip(lb.sources, per_tensor):
                if th.hexdigest() != r.digest:
                    rep.problems.append(f"{r.tensor} in {fds[r.file][2].name} changed since this pack was made "
                                        "in place from it; pack it again")
    finally:
        for fd, _, _ in fds.values():
            os.close(fd)


def _check_experts(pack: Path, index, rep: VerifyReport, bar, declared=None) -> None:
    if index.in_place:
        _check_in_place(pack, index, rep, bar)
        return
    opened = _open(pack / EXPERTS, rep)
    if opened is None:
        return
    fd, size = opened
    _check_size(EXPERTS, size, declared, rep)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        for lb in index.layers:
            for e, (off, want) in enumerate(zip(lb.offsets, lb.digests)):
                rep.blocks_checked += 1
                if off % index.alignment:
                    rep.problems.append(f"layer {lb.layer} expert {e}: block offset {off} is not aligned")
                if off + lb.block_nbytes > size:
                    rep.damaged_blocks.append((lb.layer, e))
                    rep.problems.append(f"layer {lb.layer} expert {e}: block ends at {off + lb.block_nbytes}, "
                                        f"{EXPERTS} has {size} bytes")
                    continue
                h = xxhash.xxh3_128()
                _hash_range(fd, off, lb.block_nbytes, h, bar)
                if h.hexdigest() != want:
                    rep.damaged_blocks.append((lb.layer, e))
    finally:
        os.close(fd)
