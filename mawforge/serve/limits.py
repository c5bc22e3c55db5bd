"""The HTTP edge's bounds and checks, in one place, applied before a request reaches the engine:

- the body is read with a size cap (413 past --max-body-bytes, checked on Content-Length first);
- JSON is parsed with bounded nesting (jsonio), off the event loop together with tokenization,
  so a 5 MB prompt or 100,000 nested brackets never stall /health;
- unknown top-level fields are refused with 400, as OpenAI does ("Unrecognized request
  argument supplied"): a misspelt `max_token` or `stop_token_id` would otherwise be ignored;
  so are fields of the other endpoint and values of the wrong JSON type (FIELDS, check_fields);
- `max_tokens` above what the context can hold is a 400 naming the limit, not a silent clip;
- `stop_token_ids` (a vLLM extension) is parsed and honoured.
"""
from __future__ import annotations

import dataclasses

from mawforge.errors import FormatError
from mawforge.formats import jsonio
from mawforge.front import protocol as P

MAX_BODY_BYTES = 8 << 20         # a context of 256k tokens of text is ~1 MB; 8 MB leaves room
MAX_DEPTH = 32                   # chat bodies nest 5-8 levels (tools schemas a few more)
MAX_STOP_TOKEN_IDS = 64

# Every request field either endpoint reads: OpenAI's documented ones and this server's
# extensions, with the endpoints that take it and its JSON type. It is the one list: an unknown
# field or a field of the other endpoint is refused (400, as OpenAI answers "Unrecognized request
# argument supplied"), a wrong type is refused by name; which fields are supported, accepted and
# ignored, or refused for their value is docs/openai-api.md (kept true by tests/test_openai_api.py).
C, T, B = ("chat",), ("completion",), ("chat", "completion")
FIELDS: dict[str, tuple[tuple[str, ...], str]] = {
    "model": (B, "string"), "messages": (C, "array"), "prompt": (T, "string|array"),
    "max_tokens": (B, "integer"), "max_completion_tokens": (B, "integer"), "temperature": (B, "number"),
    "top_p": (B, "number"), "n": (B, "integer"), "stream": (B, "boolean"), "stream_options": (B, "object"),
    "stop": (B, "string|array"), "seed": (B, "integer"), "presence_penalty": (B, "number"),
    "frequency_penalty": (B, "number"), "logit_bias": (B, "object"), "logprobs": (B, "boolean"),
    "top_logprobs": (C, "integer"), "user": (B, "string"), "echo": (T, "boolean"), "best_of": (T, "integer"),
    "suffix": (T, "string"),
    "tools": (C, "array"), "tool_choice": (C, "string|object"), "parallel_tool_calls": (C, "boolean"),
    "functions": (C, "array"), "function_call": (C, "string|object"), "response_format": (C, "object"),
    "reasoning_effort": (C, "string"), "reasoning": (C, "object"), "metadata": (B, "object"),
    "store": (C, "boolean"), "service_tier": (C, "string"), "modalities": (C, "array"), "audio": (C, "object"),
    "prediction": (C, "object"), "web_search_options": (C, "object"), "verbosity": (C, "string"),
    "prompt_cache_key": (C, "string"), "prompt_cache_options": (C, "object"),
    "prompt_cache_retention": (C, "string"), "safety_identifier": (C, "string"), "moderation": (C, "object"),
    # extensions (llama-server / vLLM names)
    "top_k": (B, "integer"), "min_p": (B, "number"), "ignore_eos": (B, "boolean"),
    "stop_token_ids": (B, "array"), "speculative": (B, "string"), "forced_output": (B, "string"),
    "chat_template_kwargs": (C, "object"), "reasoning_format": (C, "string"),
}
# completions' logprobs is an integer (0-5), chat's a boolean
TYPE_BY_KIND = {("completion", "logprobs"): "integer"}
KNOWN_FIELDS = frozenset(FIELDS)
_JSON = {"string": str, "array": list, "object": dict, "boolean": bool}
_ARTICLE = {"integer": "an integer", "array": "an array", "object": "an object"}


def _json_type(v) -> str:
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int) or isinstance(v, float) and v.is_integer():
        return "integer"
    if isinstance(v, float):
        return "number"
    return next((name for name, t in _JSON.items() if isinstance(v, t)), "null")


def check_fields(body: dict, kind: str) -> None:
    """Each field belongs to this endpoint and has its type (null means absent, as OpenAI takes it)."""
    other = sorted(k for k in body if kind not in FIELDS.get(k, (B,))[0])
    if other:
        raise P.ApiError(400, f"Unrecognized request argument supplied: {', '.join(other)[:200]}",
                         param=other[0][:100], code="unknown_parameter")
    for k, v in body.items():
        want = TYPE_BY_KIND.get((kind, k), FIELDS.get(k, (B, ""))[1])
        got = _json_type(v)
        if v is None or not want or got in want.split("|") or got == "integer" and "number" in want:
            continue
        names = " or ".join(_ARTICLE.get(w, f"a {w}") for w in want.split("|"))
        raise P.ApiError(400, f"Invalid type for '{k}': expected {names}, but got {_ARTICLE.get(got, f'a {got}')} "
                         f"instead.", param=k, code="invalid_type")


BODY_SLOTS = 4                   # bodies received at once; the rest wait with their sockets paused
_slots: dict = {}


def _body_slots():
    """One semaphore per event loop (tests run several servers in one process)."""
    import asyncio
    loop = asyncio.get_running_loop()
    if loop not in _slots:
        _slots.clear()
        _slots[loop] = asyncio.Semaphore(BODY_SLOTS)
    return _slots[loop]


async def read_body(request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The request body, refusing (413) anything over `limit` bytes without buffering it all.
    At most BODY_SLOTS bodies are read at once: uvicorn stops reading a socket whose body
    nobody consumes, so a burst of large uploads cannot keep the event loop (and /health) busy
    parsing HTTP for all of them together."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks, n = [], 0
    async with _body_slots():
        async for chunk in request.stream():
            n += len(chunk)
            if n > limit:
                raise _too_large(n, limit)
            chunks.append(chunk)
    return b"".join(chunks)


def _too_large(n: int, limit: int) -> P.ApiError:
    return P.ApiError(413, f"the request body has {n}+ bytes; this server accepts at most {limit} "
                      f"(--max-body-bytes)", code="request_too_large")


def parse_json(raw: bytes) -> dict:
    """A JSON object, size- and depth-bounded; ApiError 400 on anything else."""
    try:
        body = jsonio.loads(raw, "the request body", MAX_DEPTH)
    except FormatError as e:
        raise P.ApiError(400, str(e), code="invalid_json") from None
    if not isinstance(body, dict):
        raise P.ApiError(400, "the request body must be a JSON object", code="invalid_json")
    unknown = sorted(k for k in body if k not in KNOWN_FIELDS)
    if unknown:
        raise P.ApiError(400, f"Unrecognized request argument supplied: {', '.join(unknown)[:200]}",
                         param=unknown[0][:100], code="unknown_parameter")
    return body


def check_request(req: P.ApiRequest, body: dict, context: int, vocab: int) -> P.ApiRequest:
    """Limits that need the model: max_tokens (times n) against the context, stop_token_ids and
    logit_bias against the vocabulary. Returns the request with stop_token_ids set."""
    key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    if body.get(key) is not None and req.params.max_tokens > context - 1:
        raise P.ApiError(400, f"{key} is {req.params.max_tokens}, but the context is {context} tokens: at most "
                         f"{context - 1} can be generated", param=key, code="context_length_exceeded")
    if req.n > 1 and req.n * req.params.max_tokens > context - 1:
        raise P.ApiError(400, f"n is {req.n} and {key} {req.params.max_tokens}: {req.n * req.params.max_tokens} "
                         f"tokens in all, but the context is {context} tokens (at most {context - 1} can be "
                         f"generated)", param="n", code="context_length_exceeded")
    bad = [t for t, _ in req.params.logit_bias if t >= vocab]
    if bad:
        raise P.ApiError(400, f"logit_bias token id {bad[0]} is outside the vocabulary of {vocab}", param="logit_bias")
    ids = body.get("stop_token_ids")
    if ids is None:
        return req
    if (not isinstance(ids, list) or len(ids) > MAX_STOP_TOKEN_IDS
            or not all(type(t) is int and 0 <= t < vocab for t in ids)):
        raise P.ApiError(400, f"stop_token_ids must be a list of at most {MAX_STOP_TOKEN_IDS} token ids in "
                         f"[0, {vocab})", param="stop_token_ids")
    return dataclasses.replace(req, params=dataclasses.replace(req.params, stop_token_ids=tuple(ids)))


SLICE_CHARS = 16 << 10           # one tokenizer call holds the GIL for ~20-40 ms at this size


def encode_bounded(encode, text: str, context: int) -> list[int]:
    """encode(text), except that a long text is first counted in slices cut before whitespace
    (where pre-tokenizers split anyway), so that a prompt far over the context is refused after
    a few short tokenizer calls instead of one multi-second call that holds the GIL and with
    it the event loop (/health). The count per slice may include a BOS token: the slice count
    is subtracted before comparing, so only a prompt that cannot fit is refused here."""
    if len(text) <= 2 * SLICE_CHARS:
        return encode(text)
    n, start, slices = 0, 0, 0
    while start < len(text):
        end = min(len(text), start + SLICE_CHARS)
        if end < len(text):
            cut = max(text.rfind(" ", start + 1, end), text.rfind("\n", start + 1, end))
            end = cut if cut > start else end
        n += len(encode(text[start:end]))
        slices += 1
        start = end
        if n - slices >= context:
            raise P.ApiError(400, f"the prompt has more than {n - slices} tokens; the context is {context} "
                             f"(at least one position must be left to generate)", code="context_length_exceeded")
    return encode(text)
