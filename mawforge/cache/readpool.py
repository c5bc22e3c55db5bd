"""The expert store's reader pools: Python threads (ReadPool) or native ones (NativeReadPool over
kernels/native/reader.c). Demand reads go before queued prefetches in both; a read's result is
checked by ExpertStore.finish on the thread that takes it."""
from __future__ import annotations

import ctypes
import os
import threading
from collections import deque
from concurrent.futures import Future
from typing import TYPE_CHECKING

from mawforge.kernels import native

if TYPE_CHECKING:
    from mawforge.cache.store import ExpertStore


class ReadPool:
    """Reader threads serving two queues: demand reads (a miss the compute waits for) before any
    queued prefetch. With one FIFO a miss waited behind every prefetch issued before it, up to
    two layers' worth of reads in a prefill chunk (about 0.5 s at full size); here it takes the
    next free reader. `submit` and `shutdown` as concurrent.futures' executors."""

    def __init__(self, threads: int, name: str = "mawforge-read") -> None:
        self._demand: deque = deque()
        self._prefetch: deque = deque()
        self._cv = threading.Condition()
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}_{i}", daemon=True)
                         for i in range(max(1, threads))]
        for t in self._threads:
            t.start()

    def submit(self, fn, *args, demand: bool = False) -> Future:
        fut: Future = Future()
        with self._cv:
            if self._closed:
                raise RuntimeError("read pool is shut down")
            (self._demand if demand else self._prefetch).append((fut, fn, args))
            self._cv.notify()
        return fut

    def submit_read(self, store: "ExpertStore", layer: int, expert: int, dst, segs, demand: bool = False) -> Future:
        """A block read (NativeReadPool's entry point): `store.read_at` on a reader thread."""
        return self.submit(store.read_at, layer, expert, dst, segs, demand=demand)

    def _work(self) -> None:
        while True:
            with self._cv:
                while not (self._demand or self._prefetch or self._closed):
                    self._cv.wait()
                if not (self._demand or self._prefetch):
                    return                      # closed and drained
                fut, fn, args = (self._demand or self._prefetch).popleft()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:          # noqa: BLE001 - handed to the waiter
                fut.set_exception(e)

    def shutdown(self, wait: bool = True) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if wait:
            for t in self._threads:
                t.join()


def buffer_address(dst) -> int:
    """The address of a read's destination: a ctypes array (SlotMemory's) or a writable buffer."""
    if isinstance(dst, ctypes.Array):
        return ctypes.addressof(dst)
    return ctypes.addressof(ctypes.c_char.from_buffer(dst))


# re-entrant: a read dropped unfinished (its __del__ finishes it) may go while this thread holds it
_FINISH = threading.RLock()


class NativeRead:
    """One read on a NativeReadPool, answering as a concurrent.futures.Future does for what the
    expert cache asks (`done`, `result`, `exception`). The first `result` or `exception` waits
    for the read (the GIL let go), frees the native job and checks the bytes (ExpertStore.finish:
    length, digest), on the thread that asks; a later call gives the same answer."""

    __slots__ = ("_pool", "_job", "_args", "_got", "_error")

    def __init__(self, pool: "NativeReadPool", job: int, args: tuple) -> None:
        self._pool, self._job, self._args = pool, job, args
        self._got, self._error = 0, None

    def done(self) -> bool:
        return self._job is None or bool(self._pool.fns.done(self._job))

    def _finish(self) -> None:
        if self._job is None:
            return
        with _FINISH:       # one thread frees a job; another asking meanwhile waits, then sees it done
            if self._job is None:
                return
            fns, job = self._pool.fns, self._job
            got = fns.wait(self._pool.handle, job)
            fns.free(job)
            self._job = None
            store, layer, expert, dst = self._args
            self._args = None                   # the slot's memory is not held past the read
            try:
                if got < 0:
                    raise OSError(-got, f"reading layer {layer} expert {expert} from {store.path.name}: "
                                        f"{os.strerror(-got)}")
                self._got = store.finish(layer, expert, dst, got)
            except BaseException as e:  # noqa: BLE001 - given to whoever takes the result
                self._error = e

    def result(self) -> int:
        self._finish()
        if self._error is not None:
            raise self._error
        return self._got

    def exception(self) -> BaseException | None:
        self._finish()
        return self._error

    def __del__(self) -> None:
        if self._job is not None:
            self._finish()                      # never free a job a reader thread may still write


class NativeReadPool:
    """Reader threads in C (kernels/native/reader.c): demand reads before queued prefetches, as
    ReadPool, but no read takes the GIL. With Python reader threads each read's bookkeeping took
    it several times; on 2 cores, where the compute's kernels hold both, the compute thread then
    waited, back from each kernel, for a reader to be scheduled and let it go."""

    def __init__(self, fns: native.Reader, threads: int) -> None:
        self.fns = fns
        self.handle = fns.create(max(1, threads))
        self._closed = not self.handle
        if self._closed:
            raise OSError("the native read pool could not start its threads")

    def submit_read(self, store: "ExpertStore", layer: int, expert: int, dst, segs, demand: bool = False) -> NativeRead:
        if self._closed:
            raise RuntimeError("read pool is shut down")
        flat = (ctypes.c_long * (7 * len(segs)))(*(v for seg in segs for v in seg))
        job = self.fns.submit_segs(self.handle, len(segs), flat, buffer_address(dst), int(demand))
        if not job:
            raise MemoryError("the native read pool could not queue a read")
        return NativeRead(self, job, (store, layer, expert, dst))

    def shutdown(self, wait: bool = True) -> None:
        """Reads every queued job, then stops the threads (their results stay to be taken); it
        always waits (`wait` is ReadPool's signature)."""
        if not self._closed:
            self._closed = True
            self.fns.destroy(self.handle)
            self.handle = None

    def __del__(self) -> None:
        self.shutdown()
