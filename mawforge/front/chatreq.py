"""Chat requests with tools and reasoning: validate `tools`, `tool_choice`, tool messages and
template switches, render the prompt through the model's template, and shape the answer
(message.tool_calls, reasoning_content, streaming deltas) as OpenAI clients expect.

    chat = ChatFront(tokenizer, ChatDefaults(...))             # once per server
    opts = parse_chat_options(body, messages)                  # per request (raises ApiError)
    turn = chat.prepare(opts)                                  # prompt text + an OutputParser
The output format (markers, parser) comes from the template: text/tools.py.
"""
from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass, field

from mawforge.text.chat import ChatTemplate
from mawforge.errors import RequestError
from mawforge.text.outparse import OutputParser, ToolCall, argument_chunks, collect
from mawforge.front.protocol import ApiError
from mawforge.text.tools import ToolFormat, detect

REASONING_FORMATS = ("auto", "deepseek", "none")      # llama-server's --reasoning-format names
REASONING_MODES = ("auto", "on", "off")                # llama-server's --reasoning
_RESERVED = {"messages", "tools", "documents", "add_generation_prompt"}
_JSON_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


@dataclass(frozen=True)
class ChatDefaults:
    """The server's settings: `mawforge serve --reasoning-format/--reasoning/--reasoning-effort/
    --chat-template-kwargs/--chat-template-file`."""
    reasoning_format: str = "auto"
    reasoning: str = "auto"
    reasoning_effort: str | None = None
    template_kwargs: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ChatOptions:
    messages: list
    tools: list | None = None                  # OpenAI tool objects
    choice: str = "auto"                       # auto | none | required | named
    named: str | None = None
    template_kwargs: dict = field(default_factory=dict)
    reasoning_format: str | None = None        # None: the server's
    json_output: bool = False                  # response_format asks for JSON (front/structured.py)


@dataclass
class Turn:
    prompt: str
    parser: OutputParser
    forced: tuple = ()             # (index in tools, tool) the output must call (tool_choice required/named)
    named: str | None = None       # the named function, whose call opening is in the prompt
    offered: tuple = ()            # the tools under tool_choice "auto" (strict ones: front/structured.py)


# ---- request validation -------------------------------------------------------------------

def _check_schema(s, where: str) -> None:
    """Structural JSON Schema check: enough to refuse what no template or model can use."""
    if isinstance(s, bool):
        return
    if not isinstance(s, dict):
        raise ApiError(400, f"{where} must be a JSON Schema object", param="tools")
    t = s.get("type")
    if t is not None and not (t in _JSON_TYPES if isinstance(t, str) else
                              isinstance(t, list) and t and all(x in _JSON_TYPES for x in t)):
        raise ApiError(400, f"{where}.type {t!r} is not a JSON Schema type", param="tools")
    props = s.get("properties")
    if props is not None:
        if not isinstance(props, dict):
            raise ApiError(400, f"{where}.properties must be an object", param="tools")
        for k, v in props.items():
            _check_schema(v, f"{where}.properties.{k}")
    req = s.get("required")
    if req is not None and not (isinstance(req, list) and all(isinstance(r, str) for r in req)):
        raise ApiError(400, f"{where}.required must be a list of strings", param="tools")
    if "items" in s:
        _check_schema(s["items"], f"{where}.items")
    if "enum" in s and not isinstance(s["enum"], list):
        raise ApiError(400, f"{where}.enum must be a list", param="tools")


def _tools(v) -> list | None:
    if v is None:
        return None
    if not isinstance(v, list):
        raise ApiError(400, "tools must be a list of function tools", param="tools")
    seen = set()
    for i, t in enumerate(v):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise ApiError(400, f'tools[{i}] must be {{"type": "function", "function": {{...}}}}', param="tools")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ApiError(400, f"tools[{i}].function.name must be 1-64 of [A-Za-z0-9_.-]", param="tools")
        if name in seen:
            raise ApiError(400, f"tools[{i}]: the function {name!r} is given twice", param="tools")
        seen.add(name)
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise ApiError(400, f"tools[{i}].function.description must be a string", param="tools")
        params = fn.get("parameters")
        if params is not None:
            if not isinstance(params, dict) or params.get("type", "object") != "object":
                raise ApiError(400, f"tools[{i}].function.parameters must be a JSON Schema of type object",
                               param="tools")
            _check_schema(params, f"tools[{i}].function.parameters")
    return v or None


def _choice(v, tools: list | None) -> tuple[str, str | None]:
    if v is None:
        return ("auto" if tools else "none"), None
    if v in ("auto", "none", "required"):
        if v == "required" and not tools:
            raise ApiError(400, "tool_choice 'required' needs tools", param="tool_choice")
        return v, None
    fn = v.get("function") if isinstance(v, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(v, dict) or v.get("type") != "function" or not isinstance(name, str):
        raise ApiError(400, 'tool_choice must be "auto", "none", "required" or '
                            '{"type": "function", "function": {"name": ...}}', param="tool_choice")
    if not any(t["function"]["name"] == name for t in tools or ()):
        raise ApiError(400, f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
    return "named", name


def _arguments(v, where: str) -> dict:
    """OpenAI sends arguments as a JSON string; templates want the object (as transformers docs say)."""
    if isinstance(v, str):
        try:
            v = json.loads(v) if v.strip() else {}
        except ValueError:
            raise ApiError(400, f"{where}.function.arguments is not valid JSON", param="messages") from None
    if not isinstance(v, dict):
        raise ApiError(400, f"{where}.function.arguments must be a JSON object", param="messages")
    return v


def _messages(msgs: list) -> list:
    """Assistant tool calls normalized (arguments as objects, as templates expect); each tool
    message must answer a call made before it. Nothing else is added: the template sees what the
    client sent, so the prompt is what transformers renders for the same conversation."""
    out, open_calls = [], {}
    for i, m in enumerate(msgs):
        m = dict(m)
        if m["role"] == "assistant" and m.get("tool_calls") is not None:
            calls = m["tool_calls"]
            if not isinstance(calls, list):
                raise ApiError(400, f"messages[{i}].tool_calls must be a list", param="messages")
            norm = []
            for j, c in enumerate(calls):
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(c.get("id"), str):
                    raise ApiError(400, f"messages[{i}].tool_calls[{j}] needs an id and function.name",
                                   param="messages")
                args = _arguments(fn.get("arguments", {}), f"messages[{i}].tool_calls[{j}]")
                norm.append({"id": c["id"], "type": c.get("type", "function"),
                             "function": {"name": fn["name"], "arguments": args}})
                open_calls[c["id"]] = fn["name"]
            m["tool_calls"] = norm or None
            if not norm:
                del m["tool_calls"]
        elif m["role"] == "tool":
            cid = m.get("tool_call_id")
            if not isinstance(cid, str) or cid not in open_calls:
                raise ApiError(400, f"messages[{i}] (role tool) has tool_call_id {cid!r}, which answers no "
                                    f"earlier assistant tool call", param="messages")
        out.append(m)
    return out


def parse_chat_options(body: dict, messages) -> ChatOptions:
    tools = _tools(body.get("tools"))
    choice, named = _choice(body.get("tool_choice"), tools)
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict) or _RESERVED & kwargs.keys():
        raise ApiError(400, f"chat_template_kwargs must be an object without {sorted(_RESERVED)}",
                       param="chat_template_kwargs")
    kwargs = dict(kwargs)
    effort = body.get("reasoning_effort")
    if effort is not None:
        if not isinstance(effort, str):
            raise ApiError(400, "reasoning_effort must be a string", param="reasoning_effort")
        if effort == "none":                     # as llama-server: "none" turns thinking off
            kwargs.setdefault("enable_thinking", False)
        else:
            kwargs.setdefault("reasoning_effort", effort)
    fmt = body.get("reasoning_format")
    if fmt is not None and fmt not in REASONING_FORMATS:
        raise ApiError(400, f"reasoning_format must be one of {', '.join(REASONING_FORMATS)}", param="reasoning_format")
    rf = body.get("response_format")
    json_output = isinstance(rf, dict) and rf.get("type") in ("json_object", "json_schema")
    return ChatOptions(_messages(list(messages)), tools, choice, named, kwargs, fmt, json_output)


# ---- the server side ----------------------------------------------------------------------

class ChatFront:
    """The model's template and output format with the server's defaults."""

    def __init__(self, template: ChatTemplate, defaults: ChatDefaults = ChatDefaults()):
        self.template, self.defaults = template, defaults
        self.format: ToolFormat = detect(template.source)
        kw = dict(defaults.template_kwargs)
        if defaults.reasoning != "auto":
            kw.setdefault("enable_thinking", defaults.reasoning == "on")
        if defaults.reasoning_effort is not None:
            kw.setdefault("reasoning_effort", defaults.reasoning_effort)
        self.kwargs = kw

    def prepare(self, o: ChatOptions) -> Turn:
        tools = None if o.choice == "none" else o.tools
        if o.choice == "named":
            tools = [t for t in tools if t["function"]["name"] == o.named]
        kwargs = {**self.kwargs, **o.template_kwargs}
        try:
            prompt = self.template.render(o.messages, add_generation_prompt=True, tools=tools, **kwargs)
        except RequestError as e:
            raise ApiError(400, str(e), param="messages", code="chat_template_error") from None
        fmt, reasoning = self.format, (o.reasoning_format or self.defaults.reasoning_format) != "none"
        opens = bool(fmt.think) and prompt.rstrip().endswith(fmt.think[0][0])   # generation starts in thought
        schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools or ()}
        parser = OutputParser(fmt, schemas, reasoning=reasoning, tools=bool(tools),
                              start_in_reasoning=reasoning and opens)
        if o.choice in ("required", "named") and fmt.parse is not None:
            # The call's opening is written into the prompt, and the parser reads it as if the
            # model had written it; the rest is constrained where the format allows (structured.py).
            prefill = (fmt.think[0][1] + "\n\n" if opens else "") + fmt.prefix(o.named)
            prompt += prefill
            parser.feed(prefill)
            forced = tuple((i, t) for i, t in enumerate(o.tools) if o.named in (None, t["function"]["name"]))
            return Turn(prompt, parser, forced, o.named)     # front/structured.py constrains what follows
        if o.json_output and opens:          # JSON is the answer, not the thought: close the block first
            prefill = fmt.think[0][1] + "\n\n"
            prompt += prefill
            parser.feed(prefill)
        return Turn(prompt, parser, offered=tuple(tools or ()))


def message(content: str, reasoning: str | None, calls: list[ToolCall]) -> dict:
    msg = {"role": "assistant", "content": content if content or not calls else None}
    if reasoning is not None:
        msg["reasoning_content"] = reasoning
    if calls:
        msg["tool_calls"] = [c.message() for c in calls]
    return msg


def finish_reason(reason: str, calls: list) -> str:
    return "tool_calls" if calls and reason in ("stop", "length") else reason


def deltas(pieces: list, idle: str = "content") -> list[dict]:
    """One token's pieces as stream deltas: text merged per kind, a tool call as a header
    (index, id, type, name, empty arguments) and then its argument chunks, as OpenAI streams.
    A token that shows nothing yet (a marker, held text) is an empty string of the `idle` kind."""
    out: list[dict] = []
    for p in pieces:
        if isinstance(p, ToolCall):
            out.append({"tool_calls": [{"index": p.index, "id": p.id, "type": "function",
                                        "function": {"name": p.name, "arguments": ""}}]})
            out += [{"tool_calls": [{"index": p.index, "function": {"arguments": a}}]}
                    for a in argument_chunks(p.arguments)]
            continue
        key = "content" if p[0] == "content" else "reasoning_content"
        if out and list(out[-1]) == [key]:
            out[-1][key] += p[1]
        else:
            out.append({key: p[1]})
    return out or [{idle: ""}]


def shape_choice(choice: dict, parser: OutputParser, texts: list[str], reason: str) -> None:
    """A whole chat answer: the token texts through the parser into the choice's message."""
    pieces = [p for t in texts for p in parser.feed(t)] + parser.finish()
    content, reasoning, calls = collect(pieces)
    choice["message"] = message(content, reasoning, calls)
    choice["finish_reason"] = finish_reason(reason, calls)


def stream_chunks(template: dict, parser: OutputParser, text: str, last: bool) -> list[dict]:
    """One token's chunks: `template` is a chunk with an empty delta (plus the role on the first)."""
    pieces = parser.feed(text) + (parser.finish() if last else [])
    out = []
    idle = "reasoning_content" if parser.mode == "reasoning" else "content"
    for i, d in enumerate(deltas(pieces, idle)):
        c = copy.deepcopy(template)
        c["choices"][0]["delta"] = ({"role": "assistant"} if i == 0 and "role" in template["choices"][0]["delta"]
                                    else {}) | d
        out.append(c)
    return out
