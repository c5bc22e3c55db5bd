"""Aligned, page-cache-bypassing I/O for the packer.

Measured on the development VM: buffered writes into the page cache run at 0.37-0.66 GB/s
while O_DIRECT writes reach 2.6 GB/s, and cold O_DIRECT reads run at disk speed without
filling the page cache. Both classes fall back to buffered I/O where O_DIRECT is refused
(tmpfs, some network filesystems).
"""
from __future__ import annotations

import mmap
import os
from pathlib import Path

from mawforge.errors import FormatError

ALIGN = 4096
_ZEROS = bytes(1 << 16)


def _open(path, flags: int) -> tuple[int, bool]:
    if hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, flags | os.O_DIRECT, 0o644), True
        except OSError:
            pass
    return os.open(path, flags, 0o644), False


class Buffer:
    """A page-aligned anonymous buffer handed out by a Reader and given back with release()."""
    __slots__ = ("mm", "size", "_pool")

    def __init__(self, size: int, pool: list):
        self.mm, self.size, self._pool = mmap.mmap(-1, size), size, pool

    def release(self) -> None:
        self._pool.append(self)


class Reader:
    """pread of arbitrary ranges through aligned superset reads (O_DIRECT when possible)."""

    def __init__(self, paths):
        self.fds: dict[Path, tuple[int, bool]] = {}
        for p in paths:
            fd, direct = _open(p, os.O_RDONLY)
            if direct and not self._probe(fd):
                os.close(fd)
                fd, direct = os.open(p, os.O_RDONLY), False
            if not direct:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            self.fds[p] = (fd, direct)
        self._pool: list[Buffer] = []

    @staticmethod
    def _probe(fd: int) -> bool:
        mm = mmap.mmap(-1, ALIGN)
        try:
            os.preadv(fd, [mm], 0)
            return True
        except OSError:
            return False
        finally:
            mm.close()

    def _buffer(self, size: int) -> Buffer:
        size = -(-size // ALIGN) * ALIGN
        for i, b in enumerate(self._pool):
            if b.size >= size:
                return self._pool.pop(i)
        return Buffer(size, self._pool)

    def read(self, path: Path, off: int, n: int) -> tuple[Buffer, memoryview]:
        """Bytes [off, off+n) of path as a view into a Buffer (release it when done)."""
        fd, direct = self.fds[path]
        start = off - off % ALIGN if direct else off
        length = -(-(off + n - start) // ALIGN) * ALIGN if direct else n
        buf = self._buffer(length)
        got = os.preadv(fd, [memoryview(buf.mm)[:length]], start)
        if got < off - start + n:
            buf.release()
            raise FormatError(f"{Path(path).name} is truncated: short read at byte {off}")
        return buf, memoryview(buf.mm)[off - start:off - start + n]

    def close(self) -> None:
        for fd, _ in self.fds.values():
            os.close(fd)


class Writer:
    """Sequential writer at increasing offsets: data is staged in an aligned buffer and written
    in aligned chunks; gaps are zero-filled. close(size) truncates to the exact size and fsyncs."""

    def __init__(self, path: Path, stage_bytes: int = 32 << 20):
        self.fd, self.direct = _open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        self.stage = mmap.mmap(-1, stage_bytes)
        self.cap = stage_bytes
        self.base = 0        # file offset of stage[0]
        self.fill = 0

    @property
    def end(self) -> int:
        return self.base + self.fill

    def _put(self, data) -> None:
        mv = memoryview(data).cast("B")
        while len(mv):
            if self.fill == self.cap:
                self._flush()
            n = min(len(mv), self.cap - self.fill)
            self.stage[self.fill:self.fill + n] = mv[:n]
            self.fill += n
            mv = mv[n:]

    def pad_to(self, offset: int) -> int:
        """Zero-fill up to offset; returns the number of zero bytes written."""
        if offset < self.end:
            raise AssertionError(f"writer moved backwards: {offset} < {self.end}")
        gap = offset - self.end
        left = gap
        while left:
            n = min(left, len(_ZEROS))
            self._put(_ZEROS[:n])
            left -= n
        return gap

    def write_at(self, offset: int, data) -> None:
        self.pad_to(offset)
        self._put(data)

    def _flush(self, final: bool = False) -> None:
        n = self.fill if not final else -(-self.fill // ALIGN) * ALIGN
        if not final:
            n -= n % ALIGN
        if final and n > self.fill:
            self.stage[self.fill:n] = bytes(n - self.fill)
        view = memoryview(self.stage)[:n]
        done = 0
        while done < n:
            done += os.pwrite(self.fd, view[done:], self.base + done)
        tail = self.fill - n if not final else 0
        if tail > 0:
            self.stage[:tail] = self.stage[n:self.fill]
        self.base += n
        self.fill = max(tail, 0)

    def close(self, size: int) -> None:
        try:
            if self.fill:
                self._flush(final=True)
            os.ftruncate(self.fd, size)
            os.fsync(self.fd)
        finally:
            self.abort()

    def abort(self) -> None:
        """Close without flushing (after an error; the caller removes the file)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            self.stage.close()
        except BufferError:   # a view is still alive in a traceback; the GC frees it later
            pass
