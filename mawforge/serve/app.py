"""`mawforge serve`: an OpenAI-compatible HTTP server (starlette + uvicorn) over one runtime.

    GET  /health  /metrics  /v1/models  /v1/models/{id}
    POST /v1/chat/completions  /v1/completions          (stream true/false)
    POST /v1/responses  GET|DELETE /v1/responses/{id}   (serve/responses.py)
    GET  /  and /dashboard/...                           the live dashboard (serve/dashboard.py)
Every answer carries `usage` and `telemetry` (docs/telemetry.md); every request appends one
line to --telemetry-log. Which OpenAI fields are supported, ignored or refused: docs/openai-api.md;
several choices, logprobs and echo are shaped in serve/choices.py. One engine thread serves a
bounded FIFO queue (429 when full).
In-process use (tests, bench):  with ServerThread(build_app(rt, "tiny")) as s: s.url
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from mawforge.text.chat import ChatTemplate
from mawforge.engine.generate import validate
from mawforge.errors import MawError, RequestError
from mawforge.serve import limits
from mawforge.front import protocol as P
from mawforge.front.chatreq import ChatDefaults, ChatFront, Turn, parse_chat_options
from mawforge.serve.choices import Answer
from mawforge.front.structured import request_constraint
from mawforge.serve.dashboard import Board
from mawforge.serve.metrics import Metrics, prompt_cache_gauges
from mawforge.serve.responses import ResponsesApi, ResponseStore
from mawforge.serve.server import ServerThread, _Server, bind  # noqa: F401  (ServerThread: tests and bench import it here)
from mawforge.serve.worker import Channel, EngineWorker, Failure, Job, Ledger, QueueFull, ShuttingDown, watch_disconnect
from mawforge.telemetry import peak_rss_bytes, rss_bytes

def error_response(e: P.ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


class Api:
    def __init__(self, rt, model_id: str, worker: EngineWorker, ledger: Ledger, api_key: str | None,
                 max_tokens_default: int, chat: ChatFront, allow_forced_output: bool = False,
                 max_body_bytes: int = limits.MAX_BODY_BYTES):
        self.rt, self.model_id, self.worker, self.ledger = rt, model_id, worker, ledger
        self.api_key, self.max_tokens_default, self.max_body_bytes = api_key, max_tokens_default, max_body_bytes
        self.front, self.allow_forced_output = chat, allow_forced_output
        self.request_timeout_s: float | None = None    # --request-timeout-s: the engine cancels a job past it
        # JSON parsing and tokenization run here, off the event loop; two threads bound the CPU
        # and memory that a burst of large bodies can take from the engine and from /health
        self.admit_pool = ThreadPoolExecutor(2, thread_name_prefix="mawforge-admit")
        self.created = P.now()
        self.card = {"pack_digest": rt.manifest.pack_digest, "context": rt.opts.context,
                     "architecture": rt.cfg.arch, "chat_template": "model" if not chat.template.is_default
                     else "default (ChatML)", "tool_call_format": chat.format.name}

    # ---- small endpoints ----
    async def health(self, request: Request) -> JSONResponse:
        closing = self.worker.closing
        return JSONResponse({"status": "shutting_down" if closing else "ok", "model": self.model_id,
                             "queue_depth": self.worker.queue_depth, "busy": self.worker.current is not None},
                            status_code=503 if closing else 200)

    async def metrics(self, request: Request) -> Response:
        self._auth(request)                      # as llama-server: /metrics needs the key, /health does not
        body, content_type = self.prometheus.render(request.headers.get("accept"))
        return Response(body, media_type=content_type)

    def gauges(self) -> dict[str, tuple[float, str]]:
        p = self.rt.plan
        return {"queue_depth": (self.worker.queue_depth, "requests waiting for the engine"),
                "busy": (int(self.worker.current is not None), "1 while a generation runs"),
                "active_sequences": (getattr(self.worker, "active", int(self.worker.current is not None)),
                                     "requests the engine is stepping now"),
                "max_batch": (getattr(self.worker, "max_batch", 1), "--max-batch"),
                "queue_capacity": (self.worker.q.maxsize, "--max-waiting"),
                "context_tokens": (self.rt.opts.context, "KV cache length"),
                "expert_cache_bytes": (p.E, "expert cache budget E"),
                "kv_cache_bytes": (p.K, "KV cache bytes K"),
                "resident_common_bytes": (p.C, "resident common bytes C"),
                "planned_footprint_bytes": (p.F, "planned footprint F = C + E + K + P + O"),
                **prompt_cache_gauges(self.rt),
                "budget_bytes": (p.budget_bytes or 0, "memory budget (0 = none given)"),
                "rss_bytes": (rss_bytes(), "resident set of the server process"),
                "peak_rss_bytes": (peak_rss_bytes(), "peak resident set of the server process")}

    async def models(self, request: Request) -> JSONResponse:
        self._auth(request)
        return JSONResponse(P.models_list(self.model_id, self.created, self.card))

    async def model(self, request: Request) -> JSONResponse:
        self._auth(request)
        if request.path_params["model"] != self.model_id:
            raise P.ApiError(404, f"the model {request.path_params['model']!r} does not exist",
                             param="model", code="model_not_found")
        return JSONResponse(P.model_card(self.model_id, self.created, self.card))

    def _auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise P.ApiError(401, "invalid or missing API key (Authorization: Bearer KEY)",
                             code="invalid_api_key")

    # ---- completions ----
    async def chat(self, request: Request):
        return await self._complete("chat", request)

    async def completions(self, request: Request):
        return await self._complete("completion", request)

    def _prompt_ids(self, prompt: str | tuple[int, ...]) -> list[int]:
        if isinstance(prompt, str):
            return limits.encode_bounded(self.rt.tokenizer.encode, prompt, self.rt.opts.context)
        vocab = self.rt.cfg.vocab
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise P.ApiError(400, f"token id {bad[0]} is outside the vocabulary of {vocab}", param="prompt")
        return list(prompt)

    def _prepare(self, kind: str, raw: bytes) -> tuple[P.ApiRequest, list[list[int]], Turn | None, dict, tuple]:
        """Off the event loop: bounded JSON parsing, the request's checks, the chat template,
        tokenization (one prompt, or each of a completions list), the output grammar (its
        logits processors)."""
        body = limits.parse_json(raw)
        limits.check_fields(body, kind)
        req = P.parse_request(kind, body, self.model_id, self.max_tokens_default)
        req = limits.check_request(req, body, self.rt.opts.context, self.rt.cfg.vocab)
        turn = self.front.prepare(parse_chat_options(body, req.messages)) if kind == "chat" else None
        prompts = [turn.prompt] if turn is not None else req.prompts or [req.prompt or req.prompt_ids]
        try:
            ids = [self._prompt_ids(p) for p in prompts]
            for one in ids:
                validate(self.rt, one, req.params)
        except RequestError as e:
            code = getattr(e, "code", None)      # ContextLengthError: context_length_exceeded
            param = "logit_bias" if str(e).startswith("logit_bias") else "messages" if kind == "chat" else "prompt"
            raise P.ApiError(400, str(e), param=param, code=code) from None
        constraint = request_constraint(self.rt, req.response_format, turn)
        return req, ids, turn, body, () if constraint is None else (constraint,)

    async def _admit(self, kind: str, rid: str, request: Request) -> tuple[P.ApiRequest, Job, Turn | None]:
        self._auth(request)
        raw = await limits.read_body(request, self.max_body_bytes)
        req, ids, turn, body, procs = await asyncio.get_running_loop().run_in_executor(self.admit_pool,
                                                                                      self._prepare, kind, raw)
        params, spec = self._forced(body, req)
        job = Job(rid, req.endpoint, ids[0], params, Channel(), stream=req.stream, speculative=spec, n=req.n,
                  prompts=ids if len(ids) > 1 else [], processors=procs)
        self.submit(job)
        return req, job, turn

    def submit(self, job: Job) -> None:
        """Queue a job for the engine; a full queue is OpenAI's 429 (with Retry-After), a
        shutdown a 503 (every endpoint submits through here)."""
        if self.request_timeout_s:
            job.deadline = job.submitted + self.request_timeout_s
        try:
            self.worker.submit(job)
        except QueueFull as e:
            raise P.ApiError(429, str(e), type="rate_limit_error", code="queue_full",
                             headers={"Retry-After": str(e.retry_after_s)}) from None
        except ShuttingDown as e:
            raise P.ApiError(503, str(e), type="server_error", code="shutting_down") from None

    def _forced(self, body: dict, req: P.ApiRequest):
        """The testing hook: `forced_output` (text) becomes the generated tokens, then EOS.
        Only a server started with --allow-forced-output accepts it; speculation is off for it."""
        text = body.get("forced_output")
        if text is None:
            return req.params, req.speculative
        if not self.allow_forced_output:
            raise P.ApiError(400, "forced_output is a testing hook; start the server with --allow-forced-output",
                             param="forced_output")
        if not isinstance(text, str) or not text:
            raise P.ApiError(400, "forced_output must be a non-empty string", param="forced_output")
        tok = self.rt.tokenizer
        ids = tok.encode(text, add_special=False) + sorted(tok.eos_ids)[:1]
        return replace(req.params, forced_tokens=tuple(ids)), "off"

    async def _complete(self, kind: str, request: Request):
        rid = P.new_request_id(kind)
        try:
            req, job, turn = await self._admit(kind, rid, request)
        except P.ApiError as e:
            self.ledger.record(rid, P.ENDPOINTS[kind], e.status, error=e.message)
            return error_response(e)
        except ClientDisconnect:             # gone while sending the body: counted, nobody to answer
            self.ledger.record(rid, P.ENDPOINTS[kind], 499, error="client disconnected while sending the body")
            return error_response(P.ApiError(499, "client disconnected"))
        except Exception as e:               # a bug: still an OpenAI-schema answer, logged and counted
            msg = f"internal error: {type(e).__name__}: {e}"[:500]
            self.ledger.record(rid, P.ENDPOINTS[kind], 500, error=msg)
            return error_response(P.ApiError(500, msg, type="server_error"))
        watcher = asyncio.ensure_future(watch_disconnect(request, job))
        streaming = False
        try:
            first = await job.channel.__anext__()    # wait in the queue; a Failure here is a real status
            if isinstance(first, Failure):
                return error_response(P.ApiError(first.status, first.message, first.type, code=first.code))
            if req.stream:
                streaming = True                     # from here _sse owns the job and its cancellation
                return StreamingResponse(self._sse(req, job, rid, first, turn), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Request-Id": rid})
            return await self._whole(req, job, rid, first, turn)
        finally:
            watcher.cancel()                         # StreamingResponse watches for disconnects itself
            if not streaming:
                job.cancel.set()                     # a no-op when finished; stops it if this task was cancelled

    def _answer(self, req: P.ApiRequest, rid: str, turn: Turn | None) -> Answer:
        echo = None
        if req.echo:
            tok = self.rt.tokenizer
            echo = [p if isinstance(p, str) else tok.decode(list(p))
                    for p in req.prompts or [req.prompt if req.prompt is not None else req.prompt_ids]]
        return Answer(req, rid, self.model_id, self.rt.tokenizer, turn, echo)

    async def _whole(self, req: P.ApiRequest, job: Job, rid: str, first, turn: Turn | None) -> JSONResponse:
        items = [first]
        async for item in job.channel:
            if isinstance(item, Failure):
                return error_response(P.ApiError(item.status, item.message, item.type, code=item.code))
            items.append(item)
        return JSONResponse(self._answer(req, rid, turn).whole(items), headers={"X-Request-Id": rid})

    async def _sse(self, req: P.ApiRequest, job: Job, rid: str, first, turn: Turn | None):
        """One chunk per generated token (so chunks == completion_tokens; a chat token that
        completes a tool call adds that call's header and argument chunks), then per choice its
        finish chunk, then the usage chunk if asked; the last chunk before [DONE] carries telemetry.
        Several choices (n, a list of prompts) stream one after another, each with its index."""
        shape = self._answer(req, rid, turn)
        try:
            item = first
            while item is not None:
                if isinstance(item, Failure):
                    yield P.sse(P.ApiError(item.status, item.message, item.type, code=item.code).body())
                    break
                for c in shape.chunks(item):
                    yield P.sse(c)
                item = await anext(job.channel, None)
            yield P.sse("[DONE]")
        finally:
            job.cancel.set()       # no effect once finished; stops the engine if the client left


def build_app(rt, model_id: str, *, api_key: str | None = None, max_tokens_default: int = 96,
              queue_size: int = 64, telemetry_log: str | None = None, generate_fn=None,
              close_timeout_s: float | None = 60.0, speculator=None, chat_template: str | None = None,
              chat_defaults: ChatDefaults | None = None, allow_forced_output: bool = False,
              dashboard: bool = True, max_body_bytes: int = limits.MAX_BODY_BYTES,
              responses_store: ResponseStore | None = None, max_batch: int = 1,
              request_timeout_s: float | None = None) -> Starlette:
    """The ASGI app. The engine thread starts with the app's lifespan and stops with it;
    the runtime stays the caller's to close. `generate_fn` replaces engine.generate (tests).
    `chat_template` replaces the pack's template (--chat-template-file); `allow_forced_output`
    enables the forced_output testing hook (--allow-forced-output). `max_batch` > 1 steps that
    many requests at once (serve/batching.py; the runtime's plan must count their KV: its
    options' max_batch); `request_timeout_s` cancels a request that runs past it."""
    ledger = Ledger(telemetry_log)
    kw = {"generate_fn": generate_fn} if generate_fn is not None else {}
    if max_batch > 1:
        from mawforge.serve.batching import BatchWorker
        if getattr(rt.plan, "sequences", 1) < max_batch:
            raise MawError(f"--max-batch {max_batch}: the runtime's plan holds KV for {rt.plan.sequences} "
                           "sequence(s); plan it with max_batch")
        worker = BatchWorker(rt, ledger, queue_size, max_batch, speculator=speculator, **kw)
    else:
        worker = EngineWorker(rt, ledger, queue_size, speculator=speculator, **kw)
    chat = rt.tokenizer.chat
    if chat_template is not None:
        chat = ChatTemplate(chat_template, chat.bos, chat.eos)
    api = Api(rt, model_id, worker, ledger, api_key, max_tokens_default,
              ChatFront(chat, chat_defaults or ChatDefaults()), allow_forced_output, max_body_bytes)
    api.request_timeout_s = request_timeout_s
    api.prometheus = Metrics(ledger, api.gauges)
    board = Board(rt, model_id, worker, api_key) if dashboard else None
    if board is not None:
        worker.generate = board.wrap(worker.generate)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if board is not None:
            board.attach()
        worker.start()
        try:
            yield
        finally:
            await asyncio.to_thread(worker.close, close_timeout_s)
            api.admit_pool.shutdown(wait=False, cancel_futures=True)
            ledger.close()
            if board is not None:
                board.detach()

    async def api_error(request, e: P.ApiError):
        return error_response(e)

    async def http_error(request, e: HTTPException):
        return error_response(P.ApiError(e.status_code, str(e.detail), code="not_found" if e.status_code == 404
                                         else None, headers=dict(e.headers or {})))

    async def crash(request, e: Exception):
        return error_response(P.ApiError(500, f"internal error: {type(e).__name__}: {e}", type="server_error"))

    routes = [Route("/health", api.health), Route("/metrics", api.metrics), Route("/v1/models", api.models),
              Route("/v1/models/{model:path}", api.model),
              Route("/v1/chat/completions", api.chat, methods=["POST"]),
              Route("/v1/completions", api.completions, methods=["POST"])]
    routes += ResponsesApi(api, responses_store).routes()
    routes += board.routes() if board is not None else []
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={P.ApiError: api_error, HTTPException: http_error, Exception: crash})
    app.state.worker, app.state.ledger, app.state.api, app.state.board = worker, ledger, api, board
    return app
