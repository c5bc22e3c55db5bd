"""ExpertStore: reads expert blocks from experts.pack into caller-owned, page-aligned buffers.

O_DIRECT with aligned buffers where the filesystem allows it (no page cache growing outside
the budget), else buffered pread followed by POSIX_FADV_DONTNEED on the range. A small pool
of reader threads serves concurrent misses (pread releases the GIL). Each block's digest is
checked on its first read; a mismatch raises IntegrityError for that request.
"""
from __future__ import annotations

import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from mawforge.byte_rules import PAGE, round_page  # noqa: F401  (re-exported)
from mawforge.errors import IntegrityError
from mawforge.pack.manifest import EXPERTS, ExpertIndex, digest


def aligned_buffer(nbytes: int) -> tuple[mmap.mmap, torch.Tensor]:
    """Page-aligned anonymous memory and a uint8 tensor over it (zero copy)."""
    mm = mmap.mmap(-1, round_page(max(nbytes, 1)))
    return mm, torch.frombuffer(mm, dtype=torch.uint8)


class ExpertStore:
    def __init__(self, pack: Path, index: ExpertIndex, *, direct: bool = True,
                 check_digests: bool = True, threads: int = 4):
        self.path = Path(pack) / EXPERTS
        self.index = index
        self.check_digests = check_digests
        self._verified: set[tuple[int, int]] = set()
        self._lock = threading.Lock()
        self.direct = False
        self.fd = os.open(self.path, os.O_RDONLY)
        if direct and hasattr(os, "O_DIRECT"):
            try:
                dfd = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
                if self._probe_direct(dfd):
                    os.close(self.fd)
                    self.fd, self.direct = dfd, True
                else:
                    os.close(dfd)
            except OSError:
                pass          # tmpfs and some filesystems refuse O_DIRECT: buffered fallback
        if not self.direct:
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)
        self.pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="mawforge-read")
        self.bytes_read = 0

    def _probe_direct(self, fd: int) -> bool:
        mm = mmap.mmap(-1, PAGE)
        try:
            return os.preadv(fd, [mm], 0) >= 0
        except OSError:
            return False
        finally:
            mm.close()

    def read_into(self, layer: int, expert: int, dst: mmap.mmap) -> int:
        """Read block (layer, expert) into dst (page-aligned, >= round_page(block))."""
        off, n, want = self.index.block(layer, expert)
        length = round_page(n) if self.direct else n
        got = os.preadv(self.fd, [memoryview(dst)[:length]], off)
        if got < n:
            raise IntegrityError(f"{self.path.name} is truncated at layer {layer} expert {expert}")
        if not self.direct:
            os.posix_fadvise(self.fd, off, n, os.POSIX_FADV_DONTNEED)
        if self.check_digests and (layer, expert) not in self._verified:
            if digest(memoryview(dst)[:n]) != want:
                raise IntegrityError(f"expert block layer {layer} expert {expert} is damaged "
                                     f"(digest mismatch); run `mawforge verify`")
            with self._lock:
                self._verified.add((layer, expert))
        with self._lock:
            self.bytes_read += n
        return n

    def read_many(self, jobs: list[tuple[int, int, mmap.mmap]]) -> None:
        """Read several blocks concurrently; re-raises the first error."""
        if len(jobs) == 1:
            self.read_into(*jobs[0])
            return
        for f in [self.pool.submit(self.read_into, *j) for j in jobs]:
            f.result()

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        os.close(self.fd)
