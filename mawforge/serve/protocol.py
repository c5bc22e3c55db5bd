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

from mawforge.engine.sampling import SamplingParams
from mawforge.errors import RequestError

ENDPOINTS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}
_SAMPLING_FIELDS = {f.name for f in fields(SamplingParams)}
# Fields we cannot honour: refusing them is better than answering something else than asked.
_UNSUPPORTED = {
    "chat": ("functions", "function_call", "response_format", "logit_bias"),   # tools: serve/chatreq.py
    "completion": ("suffix", "logit_bias"),
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
        code = "context_length_exceeded" if "context" in msg else None
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

    @property
    def endpoint(self) -> str:
        return ENDPOINTS[self.kind]


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


def _params(body: dict, default_max_tokens: int) -> SamplingParams:
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    if _number(body, "n", 1, int) != 1:
        raise ApiError(400, "only n = 1 is supported", param="n")
    for pen in ("presence_penalty", "frequency_penalty"):
        if _number(body, pen, 0.0) != 0.0:
            raise ApiError(400, f"{pen} is not supported (only 0)", param=pen)
    seed = _number(body, "seed", None, int)
    try:
        return SamplingParams(
            max_tokens=_number({key: max_tokens}, key, default_max_tokens, int),
            temperature=_number(body, "temperature", 1.0, lo=0.0, hi=2.0),
            top_p=_number(body, "top_p", 1.0), top_k=_number(body, "top_k", 0, int),
            min_p=_number(body, "min_p", 0.0), seed=seed, stop=_stop(body),
            ignore_eos=bool(body.get("ignore_eos", False)))
    except RequestError as e:
        raise ApiError.from_request_error(e) from None


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


def _prompt(v) -> tuple[str | None, tuple[int, ...]]:
    """A string, a list of one string, a list of token ids, or a list of one list of token ids."""
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
        v = v[0]
    if isinstance(v, str):
        return v, ()
    if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        return None, tuple(v)
    if isinstance(v, list) and len(v) > 1:
        raise ApiError(400, "only one prompt per request is supported", param="prompt")
    raise ApiError(400, "prompt must be a string or a list of token ids", param="prompt")


def parse_request(kind: str, body: dict, model_id: str, default_max_tokens: int) -> ApiRequest:
    model = body.get("model", model_id)     # lenient: a missing model means the served one
    if model != model_id:
        raise ApiError(404, f"the model {model!r} does not exist; this server serves {model_id!r}",
                       param="model", code="model_not_found")
    for key in _UNSUPPORTED[kind]:
        if body.get(key) not in (None, [], {}):
            raise ApiError(400, f"{key} is not supported by this server", param=key)
    if kind == "completion" and body.get("echo"):
        raise ApiError(400, "echo is not supported by this server", param="echo")
    if body.get("logprobs") not in (None, False, 0):
        raise ApiError(400, "logprobs are not supported by this server", param="logprobs")
    stream, include_usage = _stream_options(body)
    params = _params(body, default_max_tokens)
    spec = body.get("speculative")
    if spec is not None and spec not in SPEC_MODES:
        raise ApiError(400, f"speculative must be one of {', '.join(SPEC_MODES)}, got {spec!r}", param="speculative")
    if kind == "chat":
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise ApiError(400, "messages must be a non-empty list", param="messages")
        return ApiRequest(kind, model, stream, include_usage, params,
                          messages=tuple(_message(m, i) for i, m in enumerate(msgs)), speculative=spec)
    if "prompt" not in body:
        raise ApiError(400, "prompt is required", param="prompt")
    text, ids = _prompt(body["prompt"])
    return ApiRequest(kind, model, stream, include_usage, params, prompt=text, prompt_ids=ids,
                      speculative=spec)


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
