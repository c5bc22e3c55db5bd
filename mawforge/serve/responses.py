"""OpenAI's Responses API on the chat path: POST /v1/responses (streamed or not), GET and DELETE
/v1/responses/{id}. A request becomes chat messages (serve/respreq.py), runs through the model's
template, the engine worker and the tool-call/reasoning parser exactly as a chat request does,
and the tokens become output items and typed events (serve/respout.py).

`previous_response_id` reads the conversation (input and output items) of a stored response from
a bounded in-memory LRU (ResponseStore, --responses-store-count / --responses-store-mb); the
follow-up renders the whole conversation again, so its prompt starts with the same tokens.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from mawforge.engine.generate import validate
from mawforge.errors import MawError, RequestError
from mawforge.formats import jsonio
from mawforge.serve import limits
from mawforge.front import protocol as P
from mawforge.front.chatreq import Turn, parse_chat_options
from mawforge.serve.respout import Output, base_response, new_id
from mawforge.serve.respreq import ResponsesRequest, parse_responses, to_messages
from mawforge.front.structured import request_constraint
from mawforge.serve.worker import Channel, Failure, Job, watch_disconnect

ENDPOINT = "/v1/responses"


class ResponseStore:
    """Stored responses and their conversations, least recently used first out, bounded by
    count and by the bytes of their JSON. A response larger than the byte bound is not kept."""

    def __init__(self, max_entries: int = 1024, max_bytes: int = 64 << 20):
        if max_entries < 0 or max_bytes < 0:
            raise MawError("the responses store bounds must be >= 0")
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.entries: OrderedDict[str, tuple[dict, list, int]] = OrderedDict()
        self.bytes = 0
        self.lock = threading.Lock()

    def put(self, rid: str, response: dict, conversation: list) -> bool:
        size = len(json.dumps([response, conversation], separators=(",", ":")))
        with self.lock:
            if size > self.max_bytes or self.max_entries == 0:
                return False
            self.entries[rid] = (response, conversation, size)
            self.bytes += size
            while len(self.entries) > self.max_entries or self.bytes > self.max_bytes:
                self.bytes -= self.entries.popitem(last=False)[1][2]
            return True

    def get(self, rid: str) -> tuple[dict, list] | None:
        with self.lock:
            entry = self.entries.get(rid)
            if entry is None:
                return None
            self.entries.move_to_end(rid)
            return entry[0], entry[1]

    def delete(self, rid: str) -> bool:
        with self.lock:
            entry = self.entries.pop(rid, None)
            if entry is not None:
                self.bytes -= entry[2]
            return entry is not None


def add_responses_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--responses-store-count", type=int, default=1024,
                   help="responses kept for previous_response_id and GET /v1/responses/{id} (0: none)")
    p.add_argument("--responses-store-mb", type=float, default=64.0,
                   help="bytes (MiB) of JSON those stored responses and conversations may hold")


def store_from_args(a: argparse.Namespace) -> ResponseStore:
    return ResponseStore(a.responses_store_count, int(a.responses_store_mb * 2**20))


@dataclass
class Prepared:
    rr: ResponsesRequest
    req: P.ApiRequest
    ids: list[int]
    turn: Turn
    chat: dict
    conversation: list           # the stored history plus this turn's input items
    processors: tuple = ()       # the output's grammar (text.format, a forced tool call)
    failure: Failure | None = None   # the engine's, when the answer ended in response.failed


def _error(e: P.ApiError | Failure) -> JSONResponse:
    if isinstance(e, Failure):
        e = P.ApiError(e.status, e.message, e.type, code=e.code)
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _sse(ev: dict) -> str:
    return f"event: {ev['type']}\ndata: {json.dumps(ev, separators=(',', ':'))}\n\n"


async def _next_event(job: Job):
    """The job's next Event (a Responses request has one choice: the worker's items are
    (choice index, Event) pairs), or its Failure."""
    item = await job.channel.__anext__()
    return item if isinstance(item, Failure) else item[1]


class ResponsesApi:
    """The routes; `api` is the server's chat Api (its runtime, worker, ledger, template)."""

    def __init__(self, api, store: ResponseStore | None = None):
        self.api, self.store = api, store if store is not None else ResponseStore()

    def routes(self) -> list[Route]:
        return [Route(ENDPOINT, self.create, methods=["POST"]),
                Route(ENDPOINT + "/{response_id}", self.stored, methods=["GET", "DELETE"])]

    async def stored(self, request: Request) -> JSONResponse:
        self.api._auth(request)
        rid = request.path_params["response_id"]
        if request.method == "DELETE" and self.store.delete(rid):
            return JSONResponse({"id": rid, "object": "response.deleted", "deleted": True})
        found = self.store.get(rid) if request.method == "GET" else None
        if found is None:
            raise P.ApiError(404, f"No response found with id '{rid}'.", param="response_id", code="not_found")
        return JSONResponse(found[0])

    # ---- create ----
    def _prepare(self, raw: bytes) -> Prepared:
        """Off the event loop: JSON, the checks, the conversation, the template, tokenization."""
        api, rt = self.api, self.api.rt
        try:
            body = jsonio.loads(raw, "the request body", limits.MAX_DEPTH)
        except MawError as e:
            raise P.ApiError(400, str(e), code="invalid_json") from None
        if not isinstance(body, dict):
            raise P.ApiError(400, "the request body must be a JSON object", code="invalid_json")
        rr = parse_responses(body, rt.opts.context)
        history = []
        if rr.previous_response_id is not None:
            found = self.store.get(rr.previous_response_id)
            if found is None:
                raise P.ApiError(404, f"Previous response with id '{rr.previous_response_id}' not found.",
                                 param="previous_response_id", code="previous_response_not_found")
            history = found[1]
        conversation = history + rr.items
        chat = {**rr.chat, "messages": to_messages(rr.instructions, conversation, len(history)),
                "response_format": rr.response_format}
        req = P.parse_request("chat", chat, api.model_id, api.max_tokens_default)
        try:
            turn = api.front.prepare(parse_chat_options(chat, req.messages))
            ids = limits.encode_bounded(rt.tokenizer.encode, turn.prompt, rt.opts.context)
            validate(rt, ids, req.params)
            constraint = request_constraint(rt, req.response_format, turn)
        except P.ApiError as e:              # the conversation is `input` here, not `messages`
            if e.param in ("messages", None) and e.code in (None, "chat_template_error", "context_length_exceeded"):
                e.param = "input"
            if e.param == "response_format":
                e.param, e.message = "text.format", e.message.replace("response_format", "text.format")
            raise
        except RequestError as e:
            raise P.ApiError(400, str(e), param="input",
                             code=getattr(e, "code", None)) from None
        return Prepared(rr, req, ids, turn, chat, conversation, () if constraint is None else (constraint,))

    async def _admit(self, rid: str, request: Request) -> tuple[Prepared, Job]:
        api = self.api
        api._auth(request)
        raw = await limits.read_body(request, api.max_body_bytes)
        pr = await asyncio.get_running_loop().run_in_executor(api.admit_pool, self._prepare, raw)
        params, spec = api._forced(pr.chat, pr.req)
        job = Job(rid, ENDPOINT, pr.ids, params, Channel(), stream=pr.rr.stream, speculative=spec,
                  processors=pr.processors)
        api.submit(job)
        return pr, job

    async def create(self, request: Request):
        rid, ledger = new_id("resp"), self.api.ledger
        try:
            pr, job = await self._admit(rid, request)
        except P.ApiError as e:
            ledger.record(rid, ENDPOINT, e.status, error=e.message)
            return _error(e)
        except ClientDisconnect:
            ledger.record(rid, ENDPOINT, 499, error="client disconnected while sending the body")
            return _error(P.ApiError(499, "client disconnected"))
        except Exception as e:  # noqa: BLE001 - a bug: still an OpenAI-schema answer, logged and counted
            msg = f"internal error: {type(e).__name__}: {e}"[:500]
            ledger.record(rid, ENDPOINT, 500, error=msg)
            return _error(P.ApiError(500, msg, type="server_error"))
        out = Output(rid, base_response(rid, self.api.model_id, pr.rr.echo), pr.turn.parser, pr.rr.summary)
        watcher = asyncio.ensure_future(watch_disconnect(request, job))
        streaming = False
        try:
            first = await _next_event(job)            # wait in the queue; a Failure here is a real status
            if isinstance(first, Failure):
                return _error(first)
            if pr.rr.stream:
                streaming = True
                return StreamingResponse(self._stream(pr, job, out, first), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Request-Id": rid})
            async for _ in self._events(pr, job, out, first):
                pass
            if pr.failure is not None:                # not streamed: the engine's status, as the chat endpoint
                return _error(pr.failure)
            return JSONResponse(out.response, headers={"X-Request-Id": rid})
        finally:
            watcher.cancel()
            if not streaming:
                job.cancel.set()

    async def _events(self, pr: Prepared, job: Job, out: Output, ev):
        """Every event of the answer, in order; the stored conversation is written before the last."""
        for e in out.start():
            yield e
        while True:
            if isinstance(ev, Failure):
                code = "server_error" if ev.status >= 500 else "invalid_prompt"   # e.g. a grammar's dead end
                pr.failure, events = ev, out.finish("failed", None, ev.message, code)
                break
            for e in out.feed(ev.text):
                yield e
            if ev.finish_reason is not None:
                events = out.finish(ev.finish_reason, ev.telemetry)
                break
            ev = await _next_event(job)
        r = out.response
        if pr.rr.store and r["status"] in ("completed", "incomplete"):
            self.store.put(r["id"], r, pr.conversation + r["output"])
        for e in events:
            yield e

    async def _stream(self, pr: Prepared, job: Job, out: Output, first):
        try:
            async for e in self._events(pr, job, out, first):
                yield _sse(e)
        finally:
            job.cancel.set()       # no effect once finished; stops the engine if the client left
