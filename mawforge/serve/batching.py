"""The engine side of the server with continuous batching (`--max-batch N`, N > 1): one engine
thread steps up to N requests at once (engine/batch.py); the rest wait in the bounded FIFO queue
(`--max-waiting`, 429 beyond it).

    HTTP handler  --submit-->  queue  --admit at a step boundary, into a free KV slot-->
    each admitted job: EngineWorker._serve(job, sequence) in a greenlet of its own
    engine thread: Batch.step() over every job parked at its next forward, again and again

A job is admitted into the free slot whose live KV shares the longest prefix with its prompt
(the conversation it continues, when it ran there before). A job that ends, is cancelled or
fails frees its slot at the end of that step; the others go on. Everything a job answers
(events, failures, telemetry lines, cancellation) is EngineWorker's, unchanged.
"""
from __future__ import annotations

import queue
import threading

from mawforge.engine.batch import Batch
from mawforge.errors import MawError
from mawforge.serve.worker import EngineWorker, Failure, Job, log


class BatchWorker(EngineWorker):
    """EngineWorker's queue, answers and shutdown; up to max_batch jobs run at once."""

    def __init__(self, rt, ledger, queue_size: int = 64, max_batch: int = 2, speculator=None, **kw):
        if speculator is not None:
            raise MawError("speculative decoding runs one request at a time: use --max-batch 1 with --speculative")
        self.running: dict = {}                 # greenlet -> (job, slot)
        super().__init__(rt, ledger, queue_size, speculator=None, **kw)
        self.batch = Batch(rt, max_batch)
        self.max_batch = max_batch
        self.lock = threading.Lock()            # guards `running` against cancel_all from other threads

    @property
    def active(self) -> int:
        return len(self.running)

    @property
    def current(self) -> Job | None:
        """A running job (the dashboard and /health show one), or None when none runs."""
        return next((job for job, _ in list(self.running.values())), None)

    @current.setter
    def current(self, job) -> None:     # EngineWorker's own bookkeeping; the running dict says it here
        pass

    def _running(self) -> list[Job]:
        with self.lock:                         # cancel_all and close come from other threads
            return [job for job, _ in self.running.values()]

    def _slot_for(self, job: Job, free: list[int]) -> int:
        """The free slot whose live KV the job's first prompt reuses most (else the first free)."""
        prompt = (job.prompts or [job.prompt])[0]
        best, n_best = free[0], 0
        for i in free:
            pc = self.batch.seqs[i].prompt_cache
            n = pc.live_reusable(prompt) if pc is not None else 0
            if n > n_best:
                best, n_best = i, n
        return best

    def _start(self, job: Job, free: list[int], parked: dict) -> None:
        if job.speculative not in (None, "off"):
            self._fail(job, Failure(400, "speculative decoding runs one request at a time; this server batches "
                                         f"up to {self.max_batch} (--max-batch)", type="invalid_request_error",
                                    code="unsupported"))
            return
        slot = self._slot_for(job, free)
        seq = self.batch.seqs[slot]
        seq.job = job
        g = self.batch.spawn(lambda: self._serve(job, seq))
        free.remove(slot)
        with self.lock:
            self.running[g] = (job, slot)
        out = self.batch.advance(g)
        if out is None:
            self._finish(g, free)
        else:
            parked[g] = out

    def _finish(self, g, free: list[int]) -> None:
        with self.lock:
            _, slot = self.running.pop(g)
        free.append(slot)
        seq = self.batch.seqs[slot]
        seq.job = None

    def _run(self) -> None:
        free, parked, stop = list(range(self.max_batch)), {}, False
        while True:
            while free and not stop:            # admit at the step boundary
                try:
                    job = self.q.get(block=not self.running)
                except queue.Empty:
                    break
                if job is None:
                    stop = True
                    break
                if job.cancel.is_set():
                    self._serve(job)            # answers 499 / 503 without running
                    continue
                self._start(job, free, parked)
            if not parked:
                if stop and not self.running:
                    return
                continue
            try:
                parked = self.batch.step(parked)
            except Exception as e:              # a fault of the step itself: every running job fails with it
                log.exception("a batch step failed")
                for g in list(self.running):
                    if not g.dead:
                        g.throw(e)              # _serve answers its 500 and logs it
                parked = {}
            for g in [g for g in self.running if g.dead]:
                self._finish(g, free)
