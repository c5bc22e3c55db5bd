"""A Responses API request (POST /v1/responses) read into the chat path's terms, so that both
endpoints share one template, one tool-call parser and one engine job. No I/O, no torch.

    r = parse_responses(body)                      # raises ApiError (OpenAI's schema)
    msgs = to_messages(r.instructions, history + r.items)
    chat = {**r.chat, "messages": msgs}            # for protocol.parse_request / parse_chat_options

`input` items become chat messages (function_call items join the assistant message before them,
a reasoning item becomes the next assistant message's reasoning_content), flat function tools
become chat tools, `text.format` becomes chat's `response_format` shape (text_format), and
`reasoning.effort` becomes `reasoning_effort`.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from mawforge.front.protocol import ApiError

# OpenAI's documented create fields, plus the extensions the chat endpoint also reads.
KNOWN_FIELDS = frozenset({
    "model", "input", "instructions", "tools", "tool_choice", "max_output_tokens", "temperature", "top_p",
    "text", "reasoning", "stream", "stream_options", "store", "metadata", "previous_response_id",
    "parallel_tool_calls", "user", "include", "truncation", "background", "max_tool_calls", "service_tier",
    "prompt_cache_key", "prompt_cache_retention", "safety_identifier", "top_logprobs", "conversation", "prompt",
    "top_k", "min_p", "seed", "speculative", "chat_template_kwargs", "reasoning_format", "forced_output",
})
_PASSED = ("temperature", "top_p", "parallel_tool_calls", "user", "top_k", "min_p", "seed", "speculative",
           "chat_template_kwargs", "reasoning_format", "forced_output")
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text")
_NAME = re.compile(r"[A-Za-z0-9_\-]{1,64}")
SUMMARIES = ("auto", "concise", "detailed")
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")     # OpenAI's ReasoningEffort


@dataclass(frozen=True)
class ResponsesRequest:
    chat: dict                     # a chat-completions body without "messages"
    items: list                    # this turn's input items (stored with the output)
    instructions: str | None
    response_format: dict          # chat's shape: {"type": "text"} | json_object | json_schema
    previous_response_id: str | None
    store: bool
    stream: bool
    summary: bool                  # reasoning.summary asked: the reasoning text is also its summary
    echo: dict                     # the request fields a Response object repeats


def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, message, param=param)


def _refuse_unsupported(body: dict) -> None:
    if body.get("background"):
        raise _bad("background responses are not supported by this server", "background")
    if body.get("conversation") is not None:
        raise _bad("conversation is not supported; use previous_response_id", "conversation")
    if body.get("prompt") is not None:
        raise _bad("prompt templates are not supported by this server", "prompt")
    if body.get("top_logprobs") not in (None, 0):
        raise _bad("top_logprobs is not supported on /v1/responses", "top_logprobs")
    if body.get("truncation") not in (None, "disabled"):
        raise _bad("truncation must be 'disabled' (the server does not drop conversation items)", "truncation")
    include = body.get("include")
    if include is not None and (not isinstance(include, list) or not all(isinstance(x, str) for x in include)):
        raise _bad("include must be a list of strings", "include")
    if "message.output_text.logprobs" in (include or ()):
        raise _bad("logprobs are not supported on /v1/responses", "include")


# ---- input items -------------------------------------------------------------------------

def _parts_text(content, where: str, param: str = "input") -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where}.content must be a string or a list of text parts", param)
    out = []
    for j, p in enumerate(content):
        kind = p.get("type") if isinstance(p, dict) else None
        if kind in _TEXT_PARTS and isinstance(p.get("text"), str):
            out.append(p["text"])
        elif kind == "refusal" and isinstance(p.get("refusal"), str):
            out.append(p["refusal"])
        else:
            raise _bad(f"{where}.content[{j}]: only text parts (input_text, output_text) are supported, "
                       f"got {kind!r}", param)
    return "".join(out)


def _reasoning_text(item: dict, where: str) -> str:
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts):
        raise _bad(f"{where}: a reasoning item's content and summary must be lists of text parts", "input")
    return "".join(p["text"] for p in parts)


def _check_item(it, i: int) -> dict:
    where = f"input[{i}]"
    if not isinstance(it, dict):
        raise _bad(f"{where} must be an object", "input")
    kind = it.get("type", "message")
    if kind == "message":
        if it.get("role") not in _ROLES:
            raise _bad(f"{where}.role must be one of {', '.join(_ROLES)}", "input")
        _parts_text(it.get("content"), where)
    elif kind == "function_call":
        if not all(isinstance(it.get(k), str) for k in ("call_id", "name", "arguments")):
            raise _bad(f"{where}: a function_call needs string call_id, name and arguments", "input")
        try:
            args = json.loads(it["arguments"]) if it["arguments"].strip() else {}
        except ValueError:
            raise _bad(f"{where}.arguments is not valid JSON", "input") from None
        if not isinstance(args, dict):
            raise _bad(f"{where}.arguments must be a JSON object", "input")
    elif kind == "function_call_output":
        if not isinstance(it.get("call_id"), str):
            raise _bad(f"{where}: a function_call_output needs a string call_id", "input")
        _parts_text(it.get("output"), where)
    elif kind == "reasoning":
        _reasoning_text(it, where)
    else:
        raise _bad(f"{where}: items of type {kind!r} are not supported (message, function_call, "
                   f"function_call_output, reasoning)", "input")
    return it


def input_items(v) -> list[dict]:
    if isinstance(v, str):
        return [{"type": "message", "role": "user", "content": v}]
    if not isinstance(v, list) or not v:
        raise _bad("input must be a string or a non-empty list of items", "input")
    return [_check_item(it, i) for i, it in enumerate(v)]


def to_messages(instructions: str | None, items: list[dict], first: int = 0) -> list[dict]:
    """Chat messages for a conversation of input and output items. A function_call joins the
    assistant message just before it (text and calls of one turn are one message, as the chat
    endpoint writes them); a reasoning item goes to the next assistant message. `first`: the
    index of this request's first item (the ones before come from previous_response_id)."""
    msgs = [{"role": "system", "content": instructions}] if instructions is not None else []
    reasoning, calls = None, set()

    def assistant(content: str) -> dict:
        nonlocal reasoning
        m = {"role": "assistant", "content": content}
        if reasoning is not None:
            m["reasoning_content"], reasoning = reasoning, None
        msgs.append(m)
        return m

    for i, it in enumerate(items):
        kind = it.get("type", "message")
        if kind == "reasoning":             # an empty one (encrypted_content only) adds nothing
            text = _reasoning_text(it, "input")
            reasoning = (reasoning or "") + text if text else reasoning
        elif kind == "message" and _ROLES[it["role"]] == "assistant":
            assistant(_parts_text(it["content"], "input"))
        elif kind == "message":
            msgs.append({"role": _ROLES[it["role"]], "content": _parts_text(it["content"], "input")})
        elif kind == "function_call":
            last = msgs[-1] if msgs and reasoning is None else None
            m = last if last is not None and last["role"] == "assistant" else assistant("")
            calls.add(it["call_id"])
            m.setdefault("tool_calls", []).append({"id": it["call_id"], "type": "function", "function": {
                "name": it["name"], "arguments": it["arguments"]}})
        else:                                  # function_call_output
            if it["call_id"] not in calls:
                raise _bad(f"input[{i - first}]: no function_call with call_id {it['call_id']!r} comes before "
                           f"this function_call_output", "input")
            msgs.append({"role": "tool", "tool_call_id": it["call_id"], "content": _parts_text(it["output"], "input")})
    if reasoning is not None:                  # a turn cut short inside its reasoning
        assistant("")
    return msgs


# ---- tools, formats, reasoning ---------------------------------------------------------------

def chat_tools(v) -> list | None:
    """The Responses API's flat function tools as chat tools (chatreq validates the rest)."""
    if v is None:
        return None
    if not isinstance(v, list):
        raise _bad("tools must be a list of function tools", "tools")
    out = []
    for i, t in enumerate(v):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise _bad(f"tools[{i}]: only function tools are supported, got type {kind!r}", "tools")
        if not isinstance(t.get("name"), str):
            raise _bad(f"tools[{i}].name must be a string", "tools")
        out.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters",
                                                                          "strict") if t.get(k) is not None}})
    return out


def chat_tool_choice(v):
    if v is None or v in ("auto", "none", "required"):
        return v
    if isinstance(v, dict) and v.get("type") == "function" and isinstance(v.get("name"), str):
        return {"type": "function", "function": {"name": v["name"]}}
    raise _bad('tool_choice must be "auto", "none", "required" or {"type": "function", "name": ...}', "tool_choice")


def text_format(fmt) -> dict:
    """`text.format` as chat completions' `response_format`:
    {"type": "text"} | {"type": "json_object"} | {"type": "json_schema", "json_schema": {name, schema, strict}}."""
    if fmt is None:
        return {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind != "json_schema":
        raise _bad("text.format.type must be text, json_object or json_schema", "text.format")
    name, schema, strict = fmt.get("name"), fmt.get("schema"), fmt.get("strict")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise _bad("text.format.name must be 1-64 of [A-Za-z0-9_-]", "text.format.name")
    if not isinstance(schema, dict):
        raise _bad("text.format.schema must be a JSON Schema object", "text.format.schema")
    if strict is not None and not isinstance(strict, bool):
        raise _bad("text.format.strict must be a boolean", "text.format.strict")
    spec = {"name": name, "schema": schema, "strict": bool(strict)}
    if isinstance(fmt.get("description"), str):
        spec["description"] = fmt["description"]
    return {"type": "json_schema", "json_schema": spec}


def _reasoning(v) -> tuple[str | None, str | None]:
    if v is None:
        return None, None
    if not isinstance(v, dict):
        raise _bad("reasoning must be an object", "reasoning")
    effort, summary = v.get("effort"), v.get("summary", v.get("generate_summary"))
    if effort is not None and effort not in EFFORTS:
        raise _bad(f"reasoning.effort must be one of {', '.join(EFFORTS)}", "reasoning.effort")
    if summary is not None and summary not in SUMMARIES:
        raise _bad(f"reasoning.summary must be one of {', '.join(SUMMARIES)}", "reasoning.summary")
    return effort, summary


def _metadata(v) -> dict:
    if v is None:
        return {}
    if (not isinstance(v, dict) or len(v) > 16 or not all(isinstance(k, str) and len(k) <= 64 and isinstance(x, str)
                                                          and len(x) <= 512 for k, x in v.items())):
        raise _bad("metadata must be at most 16 string pairs (keys up to 64, values up to 512 characters)", "metadata")
    return v


def _flag(body: dict, key: str, default: bool) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(f"{key} must be a boolean", key)
    return v


def _string(body: dict, key: str) -> str | None:
    v = body.get(key)
    if v is not None and not isinstance(v, str):
        raise _bad(f"{key} must be a string", key)
    return v


def parse_responses(body: dict, context: int) -> ResponsesRequest:
    """Validate a create body and translate it (raises ApiError naming the field)."""
    unknown = sorted(k for k in body if k not in KNOWN_FIELDS)
    if unknown:
        raise ApiError(400, f"Unrecognized request argument supplied: {', '.join(unknown)[:200]}",
                       param=unknown[0][:100], code="unknown_parameter")
    if "model" in body and not isinstance(body["model"], str):         # null too, as OpenAI answers
        raise _bad("model must be a string", "model")
    _refuse_unsupported(body)
    if "input" not in body:
        raise _bad("input is required", "input")
    items = input_items(body["input"])
    instructions, prev = _string(body, "instructions"), _string(body, "previous_response_id")
    text = body.get("text") or {}
    if not isinstance(text, dict):
        raise _bad("text must be an object", "text")
    fmt = text_format(text.get("format"))
    effort, summary = _reasoning(body.get("reasoning"))
    mot = body.get("max_output_tokens")
    if mot is not None and (type(mot) is not int or not 1 <= mot < context):
        raise ApiError(400, f"max_output_tokens must be an integer in [1, {context - 1}] (the context is {context} "
                       f"tokens), got {mot!r}", param="max_output_tokens",
                       code="context_length_exceeded" if type(mot) is int and mot >= context else None)
    chat = {k: body[k] for k in _PASSED if body.get(k) is not None}
    chat.update(model=body.get("model"), max_tokens=mot, tools=chat_tools(body.get("tools")),
                tool_choice=chat_tool_choice(body.get("tool_choice")), reasoning_effort=effort)
    chat = {k: v for k, v in chat.items() if v is not None}      # a missing model means the served one
    if text.get("verbosity") not in (None, "low", "medium", "high"):
        raise _bad("text.verbosity must be low, medium or high", "text.verbosity")
    echo = {"instructions": instructions, "max_output_tokens": mot, "previous_response_id": prev,
            "metadata": _metadata(body.get("metadata")), "user": _string(body, "user"),
            "tools": [{"type": "function", "name": t["function"]["name"],
                       "description": t["function"].get("description"), "parameters": t["function"].get("parameters"),
                       "strict": t["function"].get("strict")} for t in chat.get("tools") or ()],
            "tool_choice": body.get("tool_choice") or "auto",
            "parallel_tool_calls": _flag(body, "parallel_tool_calls", True),
            "temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0),
            "reasoning": {"effort": effort, "summary": summary},
            "text": {"format": text.get("format") or {"type": "text"}, "verbosity": text.get("verbosity")},
            "truncation": "disabled", "background": False}
    return ResponsesRequest(chat, items, instructions, fmt, prev, _flag(body, "store", True),
                            _flag(body, "stream", False), summary is not None, echo)
