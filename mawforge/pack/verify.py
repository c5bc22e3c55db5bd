"""Recompute every digest of a pack and name the damaged blocks by layer and expert."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from mawforge.pack.manifest import COMMON, EXPERTS, digest, read_index, read_manifest


@dataclass
class VerifyReport:
    pack: Path
    blocks_checked: int = 0
    common_checked: int = 0
    damaged_blocks: list[tuple[int, int]] = field(default_factory=list)   # (layer, expert)
    damaged_common: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)                     # missing/short files

    @property
    def ok(self) -> bool:
        return not (self.damaged_blocks or self.damaged_common or self.problems)

    def lines(self) -> list[str]:
        out = [f"{self.pack}: {self.blocks_checked} expert blocks, {self.common_checked} common tensors checked"]
        out += [f"DAMAGED expert block: layer {l} expert {e}" for l, e in self.damaged_blocks]
        out += [f"DAMAGED common tensor: {n}" for n in self.damaged_common]
        out += [f"PROBLEM: {p}" for p in self.problems]
        out.append("OK: every digest matches" if self.ok else
                   f"FAILED: {len(self.damaged_blocks)} damaged blocks, {len(self.damaged_common)} "
                   f"damaged common tensors, {len(self.problems)} other problems")
        return out


def verify(pack: str | os.PathLike, progress: bool = False) -> VerifyReport:
    pack = Path(pack)
    man, index = read_manifest(pack), read_index(pack)
    rep = VerifyReport(pack)
    bar = None
    if progress:
        import sys

        from tqdm import tqdm
        bar = tqdm(total=index.total_bytes(), unit="B", unit_scale=True, desc="verify", file=sys.stderr)
    try:
        _check_common(pack, man, rep)
        _check_experts(pack, index, rep, bar)
    finally:
        if bar:
            bar.close()
    return rep


def _check_common(pack: Path, man, rep: VerifyReport) -> None:
    path = pack / COMMON
    if not path.exists():
        rep.problems.append(f"{COMMON} is missing")
        return
    with open(path, "rb") as f:
        for rec in man.common:
            h = xxhash.xxh3_128()
            for p in rec.parts:
                f.seek(p.offset)
                b = f.read(p.nbytes)
                if len(b) != p.nbytes:
                    rep.problems.append(f"{COMMON} is truncated inside {rec.name}")
                    break
                h.update(b)
            rep.common_checked += 1
            if h.hexdigest() != man.common_digests.get(rec.name):
                rep.damaged_common.append(rec.name)


def _check_experts(pack: Path, index, rep: VerifyReport, bar) -> None:
    path = pack / EXPERTS
    if not path.exists():
        rep.problems.append(f"{EXPERTS} is missing")
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        for lb in index.layers:
            for e, (off, want) in enumerate(zip(lb.offsets, lb.digests)):
                b = os.pread(fd, lb.block_nbytes, off)
                rep.blocks_checked += 1
                if len(b) != lb.block_nbytes or digest(b) != want:
                    rep.damaged_blocks.append((lb.layer, e))
                if bar:
                    bar.update(lb.block_nbytes)
    finally:
        os.close(fd)
