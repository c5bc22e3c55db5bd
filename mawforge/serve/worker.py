"""The engine side of the server: ONE worker thread owns the runtime and serves jobs from a
bounded FIFO queue; a Ledger counts what happened (read by serve/metrics.py) and appends one JSON
line per request to the telemetry log.

HTTP handler (event loop)                      worker thread
  job = Job(..., Channel())  --submit-->  queue.Queue(maxsize)  --> generate(rt, ids, params,
  async for item in channel  <--put-----                                  cancelled=job.cancel.is_set)
  ((choice index, Event) | Failure; None ends it)
A job with several choices (n, a list of prompts) runs them one after another, each with its own
sampler and seed (SamplingParams.for_choice); the request's telemetry (serve/choices.py merge)
rides on its last event and is logged once.
A job whose client went away has job.cancel set: skipped if still queued, stopped after its next
token if running. The telemetry line is written by the worker, so it exists even then.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import queue
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable

from mawforge.engine.generate import generate
from mawforge.engine.sampling import SamplingParams
from mawforge.errors import Cancelled, MawError
from mawforge.serve.choices import merge

log = logging.getLogger("mawforge.serve")


@dataclass(frozen=True)
class Failure:
    """A job that ended without a final Event: status and message for the client and the log."""
    status: int
    message: str
    type: str = "server_error"
    code: str | None = None


# events a client may leave unread (its socket's buffers full, its reader stalled) before the
# engine cancels its request: a client that never reads cannot hold a slot or grow the server
MAX_UNREAD = 4096


class Channel:
    """Thread-to-event-loop pipe: put() from any thread, `async for` on the loop. `unread` counts
    what was put and not yet taken (the engine cancels a job whose reader fell max_unread behind)."""

    def __init__(self, max_unread: int = MAX_UNREAD) -> None:
        self.loop = asyncio.get_running_loop()
        self.q: asyncio.Queue = asyncio.Queue()
        self.max_unread, self.sent, self.taken = max_unread, 0, 0

    @property
    def unread(self) -> int:
        return self.sent - self.taken

    def put(self, item) -> None:
        self.sent += 1
        try:
            self.loop.call_soon_threadsafe(self.q.put_nowait, item)
        except RuntimeError:          # the loop is closed: nobody is listening any more
            pass

    def __aiter__(self):
        return self

    async def __anext__(self):
        item = await self.q.get()
        self.taken += 1
        if item is None:
            raise StopAsyncIteration
        return item


@dataclass
class Job:
    request_id: str
    endpoint: str
    prompt: list[int]
    params: SamplingParams
    channel: Channel
    stream: bool = False
    speculative: str | None = None
    processors: tuple = ()           # sampling.LogitsProcessors (a structured-output Constraint)
    n: int = 1                         # choices per prompt
    prompts: list[list[int]] = field(default_factory=list)    # all prompts, when several
    cancel: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)
    deadline: float | None = None      # perf_counter time after which the engine cancels it (--request-timeout-s)

    def cancelled(self) -> bool:
        """True once the client went away, the server is stopping, or the deadline passed."""
        if self.deadline is not None and time.perf_counter() > self.deadline:
            self.cancel.set()
        return self.cancel.is_set()

    def choices(self) -> list[tuple[list[int], SamplingParams]]:
        """(prompt, params) by choice index: prompt p's j-th choice is index p * n + j."""
        return [(prompt, self.params.for_choice(j)) for prompt in (self.prompts or [self.prompt])
                for j in range(self.n)]


class QueueFull(Exception):
    def __init__(self, retry_after_s: int):
        super().__init__(f"the request queue is full; retry in {retry_after_s} s")
        self.retry_after_s = retry_after_s


class ShuttingDown(Exception):
    pass


class Ledger:
    """Counters for /metrics and the JSON-lines telemetry log; safe to call from any thread."""

    COUNTERS = ("prompt_tokens", "cached_tokens", "completion_tokens", "hits", "misses", "evictions",
                "materialized_bytes", "prefetched_bytes", "prefetch_useful_bytes", "prefetch_wasted_bytes",
                "embedding_bytes_read")
    # decode's lossy miss policy (models/miss_policy.py): experts it substituted and skipped
    MISS_COUNTERS = ("substituted_experts", "skipped_experts")

    def __init__(self, log_path: str | None = None):
        self.lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = {}
        self.totals = dict.fromkeys(self.COUNTERS + self.MISS_COUNTERS, 0)
        self.prompt_cache_hits = 0     # requests that reused a cached prompt prefix
        self.seconds = {"ttft": 0.0, "decode": 0.0, "total": 0.0, "queue": 0.0}
        self.finished = {}
        self.mean_total_s = 0.0        # exponential mean of engine time per request, for Retry-After
        self.listeners: list[Callable[[dict], None]] = []   # called with each finished telemetry dict
        try:
            self.file = open(log_path, "a", buffering=1) if log_path else None
        except OSError as e:
            raise MawError(f"cannot open the telemetry log {log_path}: {e.strerror}") from None

    def record(self, request_id: str, endpoint: str, status: int, telemetry: dict | None = None,
               error: str | None = None, stream: bool = False, queue_s: float | None = None) -> None:
        line = {"time": time.time(), "request_id": request_id, "endpoint": endpoint, "status": status,
                "stream": stream, "queue_s": queue_s, "error": error, "telemetry": telemetry}
        with self.lock:
            self.requests[(endpoint, status)] = self.requests.get((endpoint, status), 0) + 1
            if telemetry is not None:
                for k in self.COUNTERS:
                    self.totals[k] += telemetry[k]
                for k in self.MISS_COUNTERS:
                    self.totals[k] += telemetry["miss_policy"][k.split("_")[0]]
                self.prompt_cache_hits += telemetry["cached_tokens"] > 0
                for k in ("ttft", "decode", "total"):
                    self.seconds[k] += telemetry[f"{k}_s"]
                r = telemetry["finish_reason"]
                self.finished[r] = self.finished.get(r, 0) + 1
                self.mean_total_s = 0.8 * self.mean_total_s + 0.2 * telemetry["total_s"] if self.mean_total_s \
                    else telemetry["total_s"]
            if queue_s is not None:
                self.seconds["queue"] += queue_s
            if self.file is not None:
                self.file.write(json.dumps(line, separators=(",", ":")) + "\n")
        if telemetry is not None:
            for listener in self.listeners:
                listener(telemetry)

    def close(self) -> None:
        with self.lock:
            if self.file is not None:
                self.file.close()
                self.file = None


class EngineWorker:
    """One thread, one runtime, one generation at a time, jobs in arrival order."""

    def __init__(self, rt, ledger: Ledger, queue_size: int = 64, generate_fn: Callable = generate,
                 speculator=None):
        self.speculator = speculator     # the server's Speculator (None: plain unless a request asks)
        if queue_size < 1:
            raise MawError(f"--queue-size must be at least 1, got {queue_size}")
        self.rt, self.ledger, self.generate = rt, ledger, generate_fn
        self.q: queue.Queue = queue.Queue(maxsize=queue_size)
        self.current: Job | None = None
        self.closing = False           # no new jobs (shutdown began)
        self.stopping = False          # cancellations now come from shutdown, not from clients
        self.thread = threading.Thread(target=self._run, name="mawforge-engine", daemon=True)

    @property
    def queue_depth(self) -> int:
        return self.q.qsize()

    def start(self) -> None:
        self.thread.start()

    def submit(self, job: Job) -> None:
        if self.closing:
            raise ShuttingDown("the server is shutting down")
        try:
            self.q.put_nowait(job)
        except queue.Full:
            wait = (self.q.qsize() + 1) * (self.ledger.mean_total_s or 1.0)
            raise QueueFull(max(1, math.ceil(wait))) from None

    def cancel_all(self) -> None:
        """Shutdown grace is over: cancel the running job and every queued one; each still gets
        its answer (finish_reason "cancelled", or 503 if it never started) and its log line."""
        self.closing = self.stopping = True
        with self.q.mutex:
            jobs = [j for j in self.q.queue if j is not None]
        for job in jobs + self._running():
            job.cancel.set()

    def _running(self) -> list[Job]:
        """The jobs the engine is running now (one here; serve/batching.py's BatchWorker: its batch)."""
        return [self.current] if self.current is not None else []

    def close(self, timeout: float | None = None) -> None:
        """Refuse new jobs, fail the queued ones (503), cancel the running one, join the thread."""
        self.closing = True
        while True:
            try:
                job = self.q.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                self._fail(job, Failure(503, "the server shut down before this request started",
                                        code="shutting_down"))
        for job in self._running():
            job.cancel.set()
        if self.thread.is_alive():
            self.q.put(None)
            self.thread.join(timeout)

    def _run(self) -> None:
        while True:
            job = self.q.get()
            if job is None:
                return
            self.current = job
            try:
                self._serve(job)
            finally:
                self.current = None

    def _serve(self, job: Job, rt=None) -> None:
        """Run one job to its end on rt (the runtime, or a batch's Sequence), answering on its channel."""
        rt = rt if rt is not None else self.rt
        queue_s = time.perf_counter() - job.submitted
        if job.cancel.is_set():
            self._fail(job, Failure(503, "the server shut down before this request started", code="shutting_down")
                       if self.stopping else Failure(499, "the client went away before the request started",
                                                     type="cancelled", code="client_closed"), queue_s)
            return
        try:
            kw = {}
            if job.speculative is not None or self.speculator is not None:
                kw["speculative"] = self._speculator(job.speculative)
            choices, done = job.choices(), []
            # each choice gets its own grammar state, copied before any choice advances it
            procs = [tuple(p.fork() for p in job.processors) if i else job.processors for i in range(len(choices))]
            for i, (prompt, params) in enumerate(choices):
                if procs[i]:
                    kw["processors"] = procs[i]
                for ev in self.generate(rt, prompt, params, cancelled=job.cancelled, **kw):
                    if ev.telemetry is not None:
                        done.append(ev.telemetry)
                        if i == len(choices) - 1 or ev.finish_reason == "cancelled":
                            ev = replace(ev, telemetry=merge(done, sum(map(len, job.prompts or [job.prompt])), job.n))
                            self._log(job, ev.telemetry.to_dict(), queue_s)    # before the client sees the end
                    job.channel.put((i, ev))
                    if job.channel.unread > job.channel.max_unread:
                        job.cancel.set()     # a reader that stopped reading: its request ends ("cancelled")
                if ev.finish_reason == "cancelled":
                    break
        except Cancelled:            # cancelled between the pieces of its prompt (a batch's Sequence)
            self._fail(job, Failure(503, "the server shut down during this request's prompt", code="shutting_down")
                       if self.stopping else Failure(499, "the client went away during the prompt",
                                                     type="cancelled", code="client_closed"), queue_s)
            return
        except MawError as e:        # a request the engine refused (validated again there)
            self._fail(job, Failure(400, str(e), type="invalid_request_error", code=getattr(e, "code", None)),
                       queue_s)
            return
        except Exception as e:       # a bug: this request fails, the server lives on
            log.exception("request %s failed in the engine", job.request_id)
            self._fail(job, Failure(500, f"internal error in the engine: {type(e).__name__}: {e}"), queue_s)
            return
        job.channel.put(None)

    def _log(self, job: Job, tel: dict, queue_s: float) -> None:
        status = 499 if tel["finish_reason"] == "cancelled" and not self.stopping else 200
        self.ledger.record(job.request_id, job.endpoint, status, tel, stream=job.stream, queue_s=queue_s)

    def _speculator(self, mode: str | None):
        """The request's speculative mode against the server's (raises RequestError, a 400)."""
        if self.speculator is not None:
            return self.speculator.for_request(mode)
        if mode in (None, "off"):
            return None
        from mawforge.speculative.decode import SpecOptions, Speculator
        return Speculator(self.rt, SpecOptions(mode=mode))

    def _fail(self, job: Job, f: Failure, queue_s: float | None = None) -> None:
        self.ledger.record(job.request_id, job.endpoint, f.status, error=f.message, stream=job.stream,
                           queue_s=queue_s)
        job.channel.put(f)
        job.channel.put(None)


async def watch_disconnect(request, job: Job) -> None:
    """Once a request's body is read, the next ASGI message can only be the client going away:
    cancel its job then (the chat, completions and Responses endpoints all watch this way)."""
    while True:
        if (await request.receive())["type"] == "http.disconnect":
            job.cancel.set()
            return
