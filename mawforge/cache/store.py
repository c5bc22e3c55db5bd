"""ExpertStore: reads expert blocks from experts.pack into caller-owned, page-aligned buffers.

O_DIRECT with aligned buffers where the filesystem allows it (no page cache growing outside
the budget), else buffered pread followed by POSIX_FADV_DONTNEED on the range. A small pool
of reader threads serves concurrent misses and prefetches: native threads (NativeReadPool,
kernels/native/reader.c) that never take the GIL where the native library is loaded, else
Python threads (ReadPool; pread releases the GIL). Each block's digest is checked on its
first read, by whoever takes the read's result; a mismatch raises IntegrityError for that
request.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading
from pathlib import Path

import torch
import xxhash

from mawforge.byte_rules import PAGE, round_page  # noqa: F401  (re-exported)
from mawforge.errors import IntegrityError
from mawforge.kernels import native
from mawforge.cache.readpool import NativeRead, NativeReadPool, ReadPool, buffer_address  # noqa: F401  (re-exported)
from mawforge.pack.manifest import EXPERTS, ExpertIndex, digest
from mawforge.pack.sources import resolve_source  # noqa: F401  (re-exported)


def aligned_buffer(nbytes: int) -> tuple[mmap.mmap, torch.Tensor]:
    """Page-aligned anonymous memory and a uint8 tensor over it (zero copy)."""
    mm = mmap.mmap(-1, round_page(max(nbytes, 1)))
    return mm, torch.frombuffer(mm, dtype=torch.uint8)


def _libc_mremap():
    """libc's mmap, mremap and munmap (Linux), or None where there is no mremap."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        f = libc.mremap
    except (OSError, AttributeError):
        return None
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    libc.mmap.restype, libc.mmap.argtypes = vp, [vp, sz, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    f.restype, f.argtypes = vp, [vp, sz, sz, ctypes.c_int]
    libc.munmap.restype, libc.munmap.argtypes = ctypes.c_int, [vp, sz]
    return libc


_LIBC = _libc_mremap()
_FAILED = ctypes.c_void_p(-1).value
_PROT_RW, _MAP_PRIVATE_ANON, _MREMAP_MAYMOVE = (mmap.PROT_READ | mmap.PROT_WRITE,
                                               mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, 1)


class _Pages:
    """Owns one libc mapping; unmapped when the last holder drops it (the ctypes buffer and every
    tensor over it hold this object), or at once by `unmap`."""

    __slots__ = ("addr", "size")

    def __init__(self, addr: int, size: int) -> None:
        self.addr, self.size = addr, size

    def unmap(self) -> None:
        if self.addr:
            _LIBC.munmap(self.addr, self.size)
            self.addr = 0

    def __del__(self) -> None:
        self.unmap()


class SlotMemory:
    """Page-aligned anonymous memory for one expert slot: `buf` (for preadv) and `host` (a uint8
    tensor over it), resizable without giving its pages back.

    A cache whose blocks come in two sizes (a Q4_K_M layer whose down projection is Q6_K is
    larger) must turn a free slot of one size into one of the other whenever the victim and the
    miss differ in size: about every other miss. Unmapping a slot and mapping a fresh one costs
    about 2 ms of CPU for 3 MB (each page is zero-filled on first touch, inside the read; measured
    on the Intel Xeon), taken from the compute; `resize` moves the slot's pages with mremap, so only
    a growth's new pages are faulted in (about 0.1 ms). Where there is no mremap (not Linux) it maps anew.

    `resize` and `close` unmap the old range at once, as mmap.close did: the caller drops every
    tensor it will use over the memory first (a stale view is never read again)."""

    __slots__ = ("size", "buf", "host", "_pages", "_mm")

    def __init__(self, nbytes: int) -> None:
        self._pages = self._mm = None
        self._map(round_page(max(nbytes, 1)))

    def _map(self, n: int, addr: int | None = None) -> None:
        self.size = n
        if _LIBC is None:
            self._mm = mmap.mmap(-1, n)
            self.buf = self._mm
        else:
            if addr is None:
                addr = _LIBC.mmap(None, n, _PROT_RW, _MAP_PRIVATE_ANON, -1, 0)
                if addr in (None, _FAILED):
                    raise MemoryError(f"mmap of {n} bytes failed: {os.strerror(ctypes.get_errno())}")
            self._pages = _Pages(addr, n)
            self.buf = (ctypes.c_ubyte * n).from_address(addr)
            self.buf.owner = self._pages          # tensors over buf keep the mapping alive
        self.host = torch.frombuffer(self.buf, dtype=torch.uint8)

    def resize(self, nbytes: int) -> None:
        n = round_page(max(nbytes, 1))
        if n == self.size:
            return
        if _LIBC is None:
            self.close()
            self._map(n)
            return
        old = self._pages
        addr = _LIBC.mremap(old.addr, old.size, n, _MREMAP_MAYMOVE)
        if addr in (None, _FAILED):
            raise MemoryError(f"mremap to {n} bytes failed: {os.strerror(ctypes.get_errno())}")
        old.addr = 0                              # the range moved: nothing of it to unmap
        self._map(n, addr)

    def close(self) -> None:
        self.host = self.buf = None
        if self._mm is not None:
            self._mm.close()
            self._mm = None
        if self._pages is not None:
            self._pages.unmap()
            self._pages = None


def _open_direct(path: Path, direct: bool) -> tuple[int, bool]:
    """An fd of path with O_DIRECT where asked and the filesystem takes it, else buffered."""
    if direct and hasattr(os, "O_DIRECT"):
        try:
            dfd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            if _probe_direct(dfd):
                return dfd, True
            os.close(dfd)
        except OSError:
            pass          # tmpfs and some filesystems refuse O_DIRECT: buffered fallback
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    return fd, False


def _probe_direct(fd: int) -> bool:
    mm = mmap.mmap(-1, PAGE)
    try:
        return os.preadv(fd, [mm], 0) >= 0
    except OSError:
        return False
    finally:
        mm.close()


def read_segments(segs, dst) -> int:
    """The Python twin of reader.c's segment job: each (fd, off, len, dst_off, head, n, move) read
    to dst_off and, with move, its wanted bytes moved down there; returns the wanted bytes read."""
    view, total = memoryview(dst).cast("B"), 0
    for fd, off, length, at, head, n, move in segs:
        got = os.preadv(fd, [view[at:at + length]], off)
        got = max(0, min(got - head, n))
        if move and head and got:
            view[at:at + got] = bytes(view[at + head:at + head + got])
        total += got
        if got < n:
            break
    return total


class ExpertStore:
    """Reads expert blocks: from the pack's experts.pack, or, for an in-place pack, each tensor's
    bytes from its source GGUF file (a page-aligned superset read with O_DIRECT, moved down to its
    part's offset in the slot)."""

    def __init__(self, pack: Path, index: ExpertIndex, *, direct: bool = True,
                 check_digests: bool = True, threads: int = 4, native_reads: bool = True):
        self.index = index
        self.check_digests = check_digests
        self._verified: set[tuple[int, int]] = set()
        self._lock = threading.Lock()
        if index.in_place:
            self.sources = [resolve_source(pack, f) for f in index.files]
            self.path = self.sources[0]
        else:
            self.sources = [Path(pack) / EXPERTS]
            self.path = self.sources[0]
        opened = [_open_direct(p, direct) for p in self.sources]
        self.fds = [fd for fd, _ in opened]
        self.fd = self.fds[0]
        self.direct = all(d for _, d in opened)
        self._direct = [d for _, d in opened]
        fns = native.reader() if native_reads else None
        self.pool = NativeReadPool(fns, threads) if fns is not None else ReadPool(threads)
        self.bytes_read = 0

    def segments(self, layer: int, expert: int) -> list[tuple[int, int, int, int, int, int, int]]:
        """The reads of block (layer, expert): (fd, off, len, dst_off, head, n, move) each. On an
        O_DIRECT file a tensor is read as its page-aligned superset to the page its part starts in:
        where the template put the part at the offset in a page its bytes have in the file, they
        land in place; else (a part on a page boundary) they are moved down over `head`."""
        lb = self.index.layers[layer]
        if not lb.sources:
            n = lb.block_nbytes
            return [(self.fd, lb.offsets[expert], round_page(n) if self.direct else n, 0, 0, n, 0)]
        segs = []
        for t, r in zip(lb.tensors, lb.sources):
            p = t.parts[0]
            off, fd = r.offsets[expert], self.fds[r.file]
            if not self._direct[r.file]:
                segs.append((fd, off, p.nbytes, p.offset, 0, p.nbytes, 0))
                continue
            head, start = off % PAGE, p.offset - p.offset % PAGE
            segs.append((fd, off - head, round_page(head + p.nbytes), start, head, p.nbytes, int(start == p.offset)))
        return segs

    def _logical(self, layer: int) -> int:
        return self.index.layers[layer].logical_nbytes

    def read_into(self, layer: int, expert: int, dst) -> int:
        """Read block (layer, expert) into dst (page-aligned, >= its slot) on this thread."""
        return self.finish(layer, expert, dst, read_segments(self.segments(layer, expert), dst))

    def read_at(self, layer: int, expert: int, dst, segs) -> int:
        """Python reader threads' job: the block's segments read into dst, then checked."""
        return self.finish(layer, expert, dst, read_segments(segs, dst))

    def submit(self, layer: int, expert: int, dst, demand: bool = False):
        """Read block (layer, expert) into dst on the pool's threads; a Future-like answer
        (`done`, `result`, `exception`) whose result is the block's bytes."""
        return self.pool.submit_read(self, layer, expert, dst, self.segments(layer, expert), demand=demand)

    def finish(self, layer: int, expert: int, dst, got: int) -> int:
        """A read of `got` wanted bytes into dst is done: check its length and, on its first read,
        the block's digest; count it. Returns the block's bytes."""
        lb = self.index.layers[layer]
        n = self._logical(layer)
        if got < n:
            what = self.path.name if not lb.sources else self._files(lb)
            raise IntegrityError(f"{what} is truncated at layer {layer} expert {expert}")
        if not self.direct:
            for fd, off, length, *_ in self.segments(layer, expert):
                os.posix_fadvise(fd, off, length, os.POSIX_FADV_DONTNEED)
        if self.check_digests and (layer, expert) not in self._verified:
            if self._digest(lb, dst) != lb.digests[expert]:
                if lb.sources:
                    raise IntegrityError(f"expert block layer {layer} expert {expert} differs from when it was packed: "
                                         f"its source {self._files(lb)} changed; run `mawforge verify`")
                raise IntegrityError(f"expert block layer {layer} expert {expert} is damaged "
                                     f"(digest mismatch); run `mawforge verify`")
            with self._lock:
                self._verified.add((layer, expert))
        with self._lock:
            self.bytes_read += n
        return n

    @staticmethod
    def _digest(lb, dst) -> str:
        view = memoryview(dst).cast("B")
        if not lb.sources:
            return digest(view[:lb.block_nbytes])
        h = xxhash.xxh3_128()
        for t in lb.tensors:
            p = t.parts[0]
            h.update(view[p.offset:p.offset + p.nbytes])
        return h.hexdigest()

    def _files(self, lb) -> str:
        return ", ".join(sorted({self.sources[r.file].name for r in lb.sources}))

    def read_many(self, jobs: list[tuple[int, int, mmap.mmap]]) -> None:
        """Read several blocks concurrently, ahead of any queued prefetch; re-raises the first error.
        One block is read on the calling thread (it would wait for it anyway)."""
        if len(jobs) == 1:
            self.read_into(*jobs[0])
            return
        futures = [self.submit(*j, demand=True) for j in jobs]
        errors = [f.exception() for f in futures]          # every read done before the first error
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        for fd in self.fds:
            os.close(fd)
