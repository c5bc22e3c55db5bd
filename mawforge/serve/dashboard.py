"""The dashboard at `/` of `mawforge serve`: static files (mawforge/serve/static, no build step,
nothing from a CDN) fed by one server-sent-event stream.

    GET /                          the page (a key form instead, 401, when --api-key is set and not given)
    GET /dashboard/static/...      its script and style
    GET /dashboard/events          SSE: "hello" (model, plan), then a "frame" every interval
                                   (cache state and the interval's deltas) and "requests" on change
    GET /dashboard/api/requests    telemetry of the last requests
    GET /dashboard/api/replay/{id} that request's route trace replayed: the live policy and Belady

What it costs the engine: the cache core counts events per block (CacheCore.track_heat: one
array increment per access), the routing of the running request is copied per layer (the same
copy `--trace-out` makes), and a token counter. A frame is built on the event-loop thread
from CacheCore.snapshot() (C-level copies, no lock the engine waits on) and sent only while a
page is connected. benchmarks/dashboard_overhead.py measures decode tok/s with and without.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections import OrderedDict, deque
from pathlib import Path
from urllib.parse import unquote

import numpy as np
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from mawforge.cache.core import HEAT_FIELDS
from mawforge.cache.observer import CacheObserver
from mawforge.front import protocol as P
from mawforge.telemetry import peak_rss_bytes, rss_bytes
from mawforge.trace.record import TraceRecorder
from mawforge.trace.replay import Budget, replay

STATIC = Path(__file__).with_name("static")
COOKIE = "mawforge_key"
KEEP_REQUESTS = 32          # telemetry rows kept for the table
KEEP_TRACES = 8             # route traces kept for replay ...
MAX_TRACE_ROWS = 32768      # ... each at most this many (token, layer) rows of k*6 bytes: with top-8,
                            # 1.5 MiB a trace, 12 MiB for all (counted in the plan's O by serve)


def kept_trace_bytes(top_k: int) -> int:
    """The most the kept route traces hold (experts int16 + weights float32 per routed slot)."""
    return KEEP_TRACES * MAX_TRACE_ROWS * top_k * 6
REQUEST_FIELDS = ("prompt_tokens", "cached_tokens", "completion_tokens", "ttft_s", "decode_tok_s", "hit_rate", "hits",
                  "misses", "evictions", "materialized_bytes", "prefetched_bytes", "prefetch_useful_bytes",
                  "prefetch_wasted_bytes", "demand_load_s", "prefetch_stall_s", "peak_rss_bytes",
                  "finish_reason", "total_s")


class _Recording:
    def __init__(self) -> None:
        self.steps: list[tuple[str, int]] | None = []            # None: dropped (too long)
        self.records: list = []                                   # (step, layer, experts, weights)
        self.rows = 0
        self.dropped: str | None = None


class RequestTraces(CacheObserver):
    """Observes the expert cache and keeps each running request's routing, so any of the last
    requests can be replayed against Belady on demand. The engine thread only appends copies
    of the small routing arrays; the Trace is built when a replay asks for it. With batching
    (serve --max-batch) several requests record at once, each the steps its sequence ran in,
    with the rows of every sequence of those steps (what the cache saw)."""

    def __init__(self, rt):
        self.rt = rt
        self.active: dict[int, _Recording] = {}
        self._next = 0
        self.dropped: str | None = None          # why the last stopped recording was not kept

    def start(self) -> int:
        self._next += 1
        self.active[self._next] = _Recording()
        return self._next

    def stop(self, handle: int):
        """That request's routing (None if none, or too long to keep: see .dropped)."""
        r = self.active.pop(handle, None)
        if r is None:
            return None
        self.dropped = r.dropped
        return (r.steps, r.records) if r.steps and r.records else None

    def begin_step(self, kind: str, n_tokens: int, prefetch: bool = True) -> None:
        for r in self.active.values():
            if r.steps is not None:
                r.steps.append((kind, n_tokens))

    def record(self, layer: int, idx, w) -> None:
        # lookaheads are not kept: the what-if replays compare policies on routing alone, as
        # `mawforge replay` does
        for r in list(self.active.values()):
            if r.steps is None:
                continue
            r.rows += len(idx)
            if r.rows > MAX_TRACE_ROWS:
                r.steps, r.records = None, []
                r.dropped = f"the route trace passed {MAX_TRACE_ROWS} (token, layer) rows and was not kept"
            else:
                r.records.append((len(r.steps) - 1, layer, idx.copy(), w.copy()))

    def trace(self, kept):
        """(steps, records) from stop() -> a Trace, through the recorder `--trace-out` uses."""
        steps, records = kept
        c, rt = self.rt.cfg, self.rt
        rec = TraceRecorder(n_layers=c.n_layers, n_experts=c.n_experts, top_k=c.top_k,
                            block_bytes=list(rt.cache.slot_bytes), model=c.arch, pack_digest=rt.manifest.pack_digest)
        it = iter(records)
        nxt = next(it, None)
        for i, (kind, n) in enumerate(steps):
            rec.begin_step(kind, n)
            while nxt is not None and nxt[0] == i:
                rec.record(*nxt[1:])
                nxt = next(it, None)
        return rec.to_trace()


class Sampler:
    """One page's view: each frame carries the cache state and what changed since the last one."""

    def __init__(self, board: "Board"):
        self.board = board
        snap = board.core.snapshot()
        self.heat = snap["heat"]                 # [fields, layers * experts]: a new page sees what happens from now on
        self.t, self.totals = time.perf_counter(), board.totals(snap)
        self.phase = "idle"

    def frame(self) -> dict:
        b = self.board
        snap = b.core.snapshot()
        n_exp = b.n_experts
        flat = lambda key: key[0] * n_exp + key[1]
        d, self.heat = snap["heat"] - self.heat, snap["heat"]          # [fields, layers * experts]
        # the cells (layer * experts + expert) where each kind of event happened since the last frame
        events = {name: np.flatnonzero(d[f]).tolist() for f, name in enumerate(HEAT_FIELDS)}
        t, totals = time.perf_counter(), b.totals(snap)
        d = {k: totals[k] - self.totals[k] for k in totals}
        dt = t - self.t
        self.t, self.totals = t, totals
        job = b.worker.current
        phase = b.rt.cache.driver.kind if job is not None else "idle"
        prefill, self.phase = "prefill" in (phase, self.phase), phase
        point = None
        if d["tokens"] > 0 or d["accesses"] > 0:
            tok = 0 if prefill else d["tokens"]      # a prompt's reads are not any token's
            point = {"tok_s": d["tokens"] / dt if dt > 0 and not prefill else None,
                     "hit_rate": d["hits"] / d["accesses"] if d["accesses"] else None,
                     "bytes_per_token": d["read_bytes"] / tok if tok else None,
                     "stall_ms_per_token": 1000 * d["stall_s"] / tok if tok else None,
                     "stall_ms_per_s": 1000 * d["stall_s"] / dt if dt > 0 else 0.0}
        return {"t": time.time(), "busy": job is not None, "request_id": job.request_id if job else None,
                "phase": phase, "kv_pos": b.rt.kv.pos,
                "resident": np.flatnonzero(snap["resident_map"]).tolist(), "pinned": [flat(k) for k in snap["pinned"]],
                "prefetched": [flat(k) for k in snap["prefetch_pending"]], "events": events, "point": point,
                "used_bytes": snap["used_bytes"], "rss_bytes": rss_bytes(), "peak_rss_bytes": peak_rss_bytes(),
                "queue_depth": b.worker.queue_depth, "requests_seq": b.seq,
                "prompt_cache": b.rt.prompt_cache.report() if b.rt.prompt_cache is not None else None}


class Board:
    def __init__(self, rt, model_id: str, worker, api_key: str | None, interval_s: float = 0.2):
        self.rt, self.model_id, self.worker, self.api_key = rt, model_id, worker, api_key
        self.interval_s = interval_s
        self.core = rt.cache.core
        self.n_experts = rt.cfg.n_experts
        self.traces = RequestTraces(rt)
        self.tokens = 0                      # tokens generated, counted by the engine thread
        self.seq = 0                         # bumped when a request finishes
        self.requests: deque = deque(maxlen=KEEP_REQUESTS)
        self.kept: OrderedDict = OrderedDict()   # request id -> Trace, or the reason it is missing

    # ---- the engine side ------------------------------------------------------------------
    def attach(self) -> None:
        """At app start: per-block counts on, this board's request traces among the cache's
        observers (beside `--trace-out`'s recorder). Apps built one after another on one
        runtime, as in the tests, each attach and detach in turn."""
        self.core.track_heat(self.rt.cfg.n_layers, self.n_experts)
        self.rt.cache.observers.append(self.traces)

    def detach(self) -> None:
        if self.traces in self.rt.cache.observers:
            self.rt.cache.observers.remove(self.traces)

    def wrap(self, generate_fn):
        """The worker's generate, with the request's trace recorded and its telemetry kept."""
        def generate(rt, prompt, params, **kw):
            job = getattr(rt, "job", None) or self.worker.current     # a batch's Sequence knows its job
            rid = job.request_id if job is not None else P.new_request_id("completion")
            handle = self.traces.start()
            try:
                for ev in generate_fn(rt, prompt, params, **kw):
                    if ev.token is not None:
                        self.tokens += 1
                    if ev.telemetry is not None:
                        self._finished(rid, job, ev.telemetry.to_dict(), self.traces.stop(handle))
                    yield ev
            finally:
                self.traces.stop(handle)
        return generate

    def _finished(self, rid: str, job, tel: dict, trace) -> None:
        self.kept[rid] = trace if trace is not None else (self.traces.dropped or "no route trace was recorded")
        while len(self.kept) > KEEP_TRACES:
            self.kept.popitem(last=False)
        row = {"request_id": rid, "endpoint": job.endpoint if job is not None else "", "time": time.time(),
               **{k: tel[k] for k in REQUEST_FIELDS}}
        self.requests.append(row)
        self.seq += 1

    def totals(self, snap: dict | None = None) -> dict:
        snap = snap or self.core.snapshot()
        hits = sum(c[0] for _, c in snap["layers"])
        misses = sum(c[1] for _, c in snap["layers"])
        read = sum(c[3] for _, c in snap["layers"]) + snap["prefetch"]["issued_bytes"]
        cache = self.rt.cache
        return {"tokens": self.tokens, "hits": hits, "accesses": hits + misses, "read_bytes": read,
                "stall_s": cache.load_seconds + cache.prefetch_stall_seconds}

    # ---- HTTP --------------------------------------------------------------------------------
    def authorized(self, request: Request) -> bool:
        """No key: open (the server binds 127.0.0.1 unless told otherwise). A key: the Bearer
        header, or the cookie the key form sets (EventSource cannot send headers)."""
        if self.api_key is None:
            return True
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = token.strip() if scheme.lower() == "bearer" else unquote(request.cookies.get(COOKIE, ""))
        return hmac.compare_digest(given.encode(), self.api_key.encode())

    def _guard(self, request: Request) -> None:
        if not self.authorized(request):
            raise P.ApiError(401, "invalid or missing API key (Authorization: Bearer KEY)", code="invalid_api_key")

    async def page(self, request: Request):
        if not self.authorized(request):
            return FileResponse(STATIC / "login.html", status_code=401, headers={"Cache-Control": "no-store"})
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-store"})

    def hello(self) -> dict:
        rt, p = self.rt, self.rt.plan
        return {"model": self.model_id, "architecture": rt.cfg.arch, "n_layers": rt.cfg.n_layers,
                "n_experts": rt.cfg.n_experts, "top_k": rt.cfg.top_k, "context": rt.opts.context,
                "policy": rt.opts.policy, "prefetch": rt.prefetch_spec or "none", "interval_s": self.interval_s,
                "heat_fields": list(HEAT_FIELDS), "auth": self.api_key is not None,
                "plan": {"C": p.C, "E": p.E, "K": p.K, "P": p.P, "O": p.O, "L": p.L, "F": p.F,
                         "budget_bytes": p.budget_bytes, "budget_source": p.budget_source,
                         "cache_percent": p.cache_percent, "feasible": p.feasible}}

    async def events(self, request: Request):
        self._guard(request)

        async def stream():
            sampler, seq = Sampler(self), -1
            yield _sse("hello", self.hello())
            while not self.worker.closing:
                frame = sampler.frame()
                yield _sse("frame", frame)
                if frame["requests_seq"] != seq:
                    seq = frame["requests_seq"]
                    yield _sse("requests", list(self.requests))
                await asyncio.sleep(self.interval_s)

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def request_list(self, request: Request) -> JSONResponse:
        self._guard(request)
        return JSONResponse(list(self.requests))

    async def replay(self, request: Request) -> JSONResponse:
        self._guard(request)
        rid = request.path_params["rid"]
        trace = self.kept.get(rid)
        if trace is None:
            raise P.ApiError(404, f"no route trace kept for request {rid!r} (the last {KEEP_TRACES} are kept)",
                             code="not_found")
        if isinstance(trace, str):
            raise P.ApiError(409, trace, code="trace_unavailable")
        return JSONResponse(await asyncio.to_thread(self._replay, rid, trace))

    def _replay(self, rid: str, kept) -> dict:
        """The live policy and the two Belady references on the request's trace, all from an
        empty cache of the live capacity (the live run began with whatever was resident)."""
        trace = self.traces.trace(kept)
        cap = self.rt.cache.capacity
        budget = Budget("live", cap, 100.0 * cap / trace.total_expert_bytes)
        live = next((r for r in reversed(self.requests) if r["request_id"] == rid), None)
        rows = replay(trace, [budget], [self.rt.opts.policy, "belady", "belady-pinned"],
                      prefetch=self.rt.prefetch_spec or "none")
        keep = ("policy", "policy_spec", "prefetch", "status", "note", "hits", "misses", "hit_rate",
                "evictions", "loaded_bytes")
        return {"request_id": rid, "steps": trace.n_steps, "capacity_bytes": cap,
                "lookahead": self.rt.lookahead,
                "live": None if live is None else {k: live[k] for k in ("hits", "misses", "hit_rate")},
                "rows": [{k: r[k] for k in keep} for r in rows]}

    def routes(self) -> list:
        return [Route("/", self.page), Route("/dashboard/events", self.events),
                Route("/dashboard/api/requests", self.request_list),
                Route("/dashboard/api/replay/{rid}", self.replay),
                Mount("/dashboard/static", app=StaticFiles(directory=STATIC), name="dashboard-static")]


def _sse(event: str, data) -> str:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"
