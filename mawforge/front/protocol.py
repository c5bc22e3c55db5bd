"""OpenAI wire format: request parsing into plain dataclasses, response and SSE chunk shapes,
and the error schema `{"error": {"message", "type", "param", "code"}}`. No I/O, no torch.

    req = parse_request("chat", body, model_id="tiny", default_max_tokens=96)   # raises ApiError
    chat_response(rid, created, model, text, finish, usage, telemetry)        # -> dict
"""
from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, fields

from mawforge.engine.sampling import MAX_LOGPROBS, SamplingParams
from mawforge.errors import RequestError

ENDPOINTS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}
_SAMPLING_FIELDS = {f.name for f in fields(SamplingParams)}
# Fields we cannot honour: refusing them is better than answering something else than asked.
_UNSUPPORTED = {
    "chat": ("functions", "function_call", "audio", "web_search_options"),  # tools: chatreq.py
    "completion": ("suffix",),
}


class ApiError(Exception):
    """An HTTP error in OpenAI's schema; raised anywhere on the request path, rendered once."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @classmethod
    def from_request_error(cls, e: RequestError) -> "ApiError":
        """SamplingParams/generate messages start with the field they are about: use it as param."""
        msg = str(e)
        first = msg.split(" ", 1)[0]
        code = getattr(e, "code", None)          # ContextLengthError: context_length_exceeded
        return cls(400, msg, param=first if first in _SAMPLING_FIELDS else None, code=code)


@dataclass(frozen=True)
class ApiRequest:
    kind: str                          # "chat" | "completion"
    model: str
    stream: bool
    include_usage: bool
    params: SamplingParams
    messages: tuple[dict, ...] = ()    # chat
    prompt: str | None = None          # completion, as text
    prompt_ids: tuple[int, ...] = ()   # completion, given as token ids
    speculative: str | None = None     # per-request speculative mode (None: the server's setting)
    response_format: dict | None = None  # parse_response_format's shape (None: free text)
    n: int = 1                         # choices per prompt
    echo: bool = False                 # completions: the prompt before each choice's text
    prompts: tuple = ()                # completions given a list of prompts: each a str or a tuple of ids

    @property
    def endpoint(self) -> str:
        return ENDPOINTS[self.kind]


MAX_CHOICES = 16                 # n, and prompts in one completions request (each choice runs in turn)
MAX_LOGIT_BIAS = 1024            # OpenAI's bound on logit_bias entries

SPEC_MODES = ("auto", "off", "ngram", "draft", "mtp")


def new_request_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def parse_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    return body


def _number(body: dict, key: str, default, kind=float, lo=None, hi=None):
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not float(v).is_integer()):
        raise ApiError(400, f"{key} must be {'an integer' if kind is int else 'a number'}, got {v!r}", param=key)
    if isinstance(v, float) and not math.isfinite(v):
        raise ApiError(400, f"{key} must be finite, got {v!r}", param=key)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ApiError(400, f"{key} must be in [{lo}, {hi}], got {v!r}", param=key)
    return kind(v)


def _stop(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise ApiError(400, "stop must be a string or a list of strings", param="stop")
    return tuple(s for s in items if s)


def _params(kind: str, body: dict, default_max_tokens: int) -> SamplingParams:
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    seed = _number(body, "seed", None, int)
    try:
        return SamplingParams(
            max_tokens=_number({key: max_tokens}, key, default_max_tokens, int),
            temperature=_number(body, "temperature", 1.0, lo=0.0, hi=2.0),
            top_p=_number(body, "top_p", 1.0), top_k=_number(body, "top_k", 0, int),
            min_p=_number(body, "min_p", 0.0), seed=seed, stop=_stop(body),
            ignore_eos=bool(body.get("ignore_eos", False)), logprobs=_logprobs(kind, body),
            logit_bias=_logit_bias(body), presence_penalty=_number(body, "presence_penalty", 0.0, lo=-2, hi=2),
            frequency_penalty=_number(body, "frequency_penalty", 0.0, lo=-2, hi=2))
    except RequestError as e:
        raise ApiError.from_request_error(e) from None


def _logprobs(kind: str, body: dict) -> int | None:
    """Chat: logprobs (bool) and top_logprobs (0-20); completions: logprobs (0-5). None: off."""
    if kind == "completion":
        return _number(body, "logprobs", None, int, lo=0, hi=5)
    on, top = body.get("logprobs"), _number(body, "top_logprobs", None, int, lo=0, hi=MAX_LOGPROBS)
    if on is not None and not isinstance(on, bool):
        raise ApiError(400, f"logprobs must be a boolean, got {on!r}", param="logprobs")
    if top is not None and not on:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    return (top or 0) if on else None


def _logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    v = body.get("logit_bias") or {}
    if not isinstance(v, dict) or len(v) > MAX_LOGIT_BIAS:
        raise ApiError(400, f"logit_bias must be an object of at most {MAX_LOGIT_BIAS} token ids", param="logit_bias")
    out = []
    for k, b in v.items():
        if not (isinstance(k, str) and k.isascii() and k.isdigit()):
            raise ApiError(400, f"logit_bias keys must be token ids, got {k[:20]!r}", param="logit_bias")
        out.append((int(k), _number({"logit_bias": b}, "logit_bias", 0.0, lo=-100, hi=100)))
    return tuple(out)


def _stream_options(body: dict) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise ApiError(400, "stream must be a boolean", param="stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise ApiError(400, "stream_options must be an object", param="stream_options")
    return bool(stream), bool(opts.get("include_usage", False))


def _message(m, i: int) -> dict:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise ApiError(400, f"messages[{i}] must be an object with a string role", param=f"messages[{i}]")
    content = m.get("content")
    if isinstance(content, list):     # content parts: only text can reach a text model
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise ApiError(400, f"messages[{i}].content: only text parts are supported", param=f"messages[{i}]")
        content = "".join(p["text"] for p in content)
    elif content is None:
        content = ""
    elif not isinstance(content, str):
        raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts",
                       param=f"messages[{i}]")
    return {**m, "content": content}


def _ids(v) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


def _prompts(v) -> tuple:
    """A string, a list of token ids, or a list of those: each prompt a str or a tuple of ids."""
    if isinstance(v, str) or _ids(v):
        v = [v]
    if not isinstance(v, list) or not v or not all(isinstance(p, str) or _ids(p) for p in v):
        raise ApiError(400, "prompt must be a string, a list of token ids, or a list of those", param="prompt")
    if len(v) > MAX_CHOICES:
        raise ApiError(400, f"at most {MAX_CHOICES} prompts per request, got {len(v)}", param="prompt")
    return tuple(p if isinstance(p, str) else tuple(p) for p in v)


_FORMAT_NAME = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
MAX_SCHEMA_CHARS = 256 * 1024


def parse_response_format(v, param: str = "response_format") -> dict | None:
    """OpenAI's response_format (or the Responses API's text.format, flattened by the caller) as
    None (text: no constraint), {"type": "json_object"} or {"type": "json_schema", "name", "schema",
    "strict"}. front/structured.py turns it into a grammar."""
    if v is None:
        return None
    kind = v.get("type") if isinstance(v, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind != "json_schema":
        raise ApiError(400, f'{param} must be {{"type": "text" | "json_object" | "json_schema", ...}}', param=param)
    spec = v.get("json_schema", v)           # chat nests it; text.format is flat
    if not isinstance(spec, dict):
        raise ApiError(400, f"{param}.json_schema must be an object", param=param)
    name, schema, strict = spec.get("name"), spec.get("schema", {}), spec.get("strict")
    if not isinstance(name, str) or not 1 <= len(name) <= 64 or set(name) - _FORMAT_NAME:
        raise ApiError(400, f"{param}.json_schema.name must be 1-64 of [a-zA-Z0-9_-]", param=param)
    if not isinstance(schema, dict):
        raise ApiError(400, f"{param}.json_schema.schema must be a JSON Schema object", param=param)
    if strict is not None and not isinstance(strict, bool):
        raise ApiError(400, f"{param}.json_schema.strict must be a boolean", param=param)
    size = len(json.dumps(schema))
    if size > MAX_SCHEMA_CHARS:
        raise ApiError(400, f"{param}.json_schema.schema is {size} characters; the limit is {MAX_SCHEMA_CHARS}",
                       param=param)
    return {"type": "json_schema", "name": name, "schema": schema, "strict": bool(strict)}


def parse_request(kind: str, body: dict, model_id: str, default_max_tokens: int) -> ApiRequest:
    model = body.get("model", model_id)     # lenient: a missing model means the served one
    if not isinstance(model, str):
        raise ApiError(400, f"model must be a string naming the model, got {json.dumps(model)[:40]}",
                       param="model", code="invalid_type" if model is not None else "missing_required_parameter")
    if model != model_id:
        raise ApiError(404, f"the model {model!r} does not exist; this server serves {model_id!r}",
                       param="model", code="model_not_found")
    for key in _UNSUPPORTED[kind]:
        if body.get(key) not in (None, [], {}):
            raise ApiError(400, f"{key} is not supported by this server", param=key)
    if body.get("modalities") not in (None, ["text"]):
        raise ApiError(400, 'modalities: this server answers in text only (["text"])', param="modalities")
    stream, include_usage = _stream_options(body)
    params = _params(kind, body, default_max_tokens)
    n = _number(body, "n", 1, int, lo=1, hi=MAX_CHOICES)
    best_of = _number(body, "best_of", None, int)
    if best_of not in (None, n):
        raise ApiError(400, "best_of is not supported (only equal to n: no candidates are ranked)", param="best_of")
    spec = body.get("speculative")
    if spec is not None and spec not in SPEC_MODES:
        raise ApiError(400, f"speculative must be one of {', '.join(SPEC_MODES)}, got {spec!r}", param="speculative")
    if kind == "chat":
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise ApiError(400, "messages must be a non-empty list", param="messages")
        return ApiRequest(kind, model, stream, include_usage, params,
                          messages=tuple(_message(m, i) for i, m in enumerate(msgs)), speculative=spec, n=n,
                          response_format=parse_response_format(body.get("response_format")))
    if "prompt" not in body:
        raise ApiError(400, "prompt is required", param="prompt")
    echo = body.get("echo", False)
    if not isinstance(echo, bool) and echo is not None:
        raise ApiError(400, "echo must be a boolean", param="echo")
    if echo and params.logprobs is not None:
        raise ApiError(400, "echo with logprobs is not supported (the prompt's logprobs are not computed)",
                       param="echo")
    prompts = _prompts(body["prompt"])
    if n * len(prompts) > MAX_CHOICES:
        raise ApiError(400, f"n times the prompts is {n * len(prompts)} choices; at most {MAX_CHOICES}", param="n")
    text, ids = (prompts[0], ()) if isinstance(prompts[0], str) else (None, prompts[0])
    return ApiRequest(kind, model, stream, include_usage, params, prompt=text, prompt_ids=ids,
                      speculative=spec, n=n, echo=bool(echo), prompts=prompts if len(prompts) > 1 else ())


# ---- responses ---------------------------------------------------------------------------

def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; prompt_tokens_details.cached_tokens: the prompt cache's reuse."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _object(kind: str, chunk: bool) -> str:
    return ("chat.completion" if kind == "chat" else "text_completion") + (".chunk" if chunk and kind == "chat" else "")


def _choice(kind: str, text: str | None, finish: str | None, chunk: bool) -> dict:
    if kind == "completion":
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
    if chunk:
        return {"index": 0, "delta": {} if text is None else {"content": text}, "logprobs": None,
                "finish_reason": finish}
    return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
            "finish_reason": finish}


def response(kind: str, rid: str, created: int, model: str, text: str, finish: str, use: dict,
             telemetry: dict) -> dict:
    return {"id": rid, "object": _object(kind, False), "created": created, "model": model,
            "choices": [_choice(kind, text, finish, False)], "usage": use, "telemetry": telemetry}


def chunk(kind: str, rid: str, created: int, model: str, text: str | None = None, finish: str | None = None,
          role: bool = False, use: dict | None = None, telemetry: dict | None = None,
          choices: bool = True) -> dict:
    """One SSE chunk. `choices=False` is the include_usage chunk (empty choices)."""
    out = {"id": rid, "object": _object(kind, True), "created": created, "model": model,
           "choices": [_choice(kind, text, finish, True)] if choices else []}
    if role and kind == "chat":
        out["choices"][0]["delta"]["role"] = "assistant"
    if use is not None:
        out["usage"] = use
    if telemetry is not None:
        out["telemetry"] = telemetry
    return out


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, separators=(',', ':'))}\n\n"


def models_list(model_id: str, created: int, extra: dict) -> dict:
    return {"object": "list", "data": [model_card(model_id, created, extra)]}


def model_card(model_id: str, created: int, extra: dict) -> dict:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "mawforge", **extra}


def now() -> int:
    return int(time.time())
