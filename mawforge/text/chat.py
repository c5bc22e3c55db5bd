"""Chat templates rendered the way Hugging Face `transformers` renders them, so a prompt built here
is byte-for-byte the prompt the model was trained and evaluated with.

transformers (`utils/chat_template_utils.py`) compiles every template in an
ImmutableSandboxedEnvironment(trim_blocks, lstrip_blocks) with the `loopcontrols` extension and a
`{% generation %}` tag, replaces jinja's `tojson` (which sorts keys and HTML-escapes) with plain
`json.dumps(x, ensure_ascii=False, indent, separators, sort_keys=False)`, adds the globals
`raise_exception` and `strftime_now`, and renders with `messages`, `tools`, `documents` and
`add_generation_prompt` always defined (None when absent) plus the tokenizer's special tokens and
any extra keyword (`enable_thinking`, `reasoning_effort`, ...). Since 5.x it also drops message
keys whose value is None, copies a message's reasoning under `reasoning_content` and `thinking`
(gpt-oss reads the latter), and guards `namespace` against underscore attributes. Each of those
details changes the output of some real template (Llama 3.1 `tojson(indent=4)`, Gemma 4 key
order, gpt-oss dates and `thinking`, Mistral `tools is defined`); tests/test_chat_templates.py
checks them against transformers itself.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime

from jinja2 import nodes
from jinja2.exceptions import SecurityError
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

from mawforge.errors import FormatError, RequestError

# Used when the model carries no chat template (documented in docs/telemetry.md and README).
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class _Generation(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in
    transformers; for rendering it is the identity, as transformers' AssistantTracker is then."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_identity"), [], [], body).set_lineno(lineno)

    def _identity(self, caller):
        return caller()


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _one_line(text) -> str:
    return " ".join(str(text).split())


def _raise(msg: str):
    raise RequestError(f"the chat template refused these messages: {_one_line(msg)}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Namespace(Namespace):
    """jinja's namespace() without underscore-prefixed attributes (sandbox hardening, as transformers)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"chat templates cannot store underscore-prefixed attributes ({name!r})")


def environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    return env


def _plain(v):
    """JSON-shaped data rebuilt from plain types: the template never sees (or mutates) the caller's objects."""
    if v is None or type(v) in (str, int, float, bool):
        return v
    if isinstance(v, Mapping):
        return {_plain(k): _plain(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_plain(x) for x in v]
    if isinstance(v, tuple):
        return tuple(_plain(x) for x in v)
    for kind in (str, int, float):
        if isinstance(v, kind):
            return kind(v)
    return f"<{type(v).__name__}>"


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def template_messages(messages: list[dict]) -> list[dict]:
    """transformers' normalization: keys whose value is None are dropped (templates test for a
    missing key, not for None), and reasoning given under any of its names is copied under
    `reasoning_content` and `thinking`."""
    out = []
    for m in messages:
        m = {k: _plain(v) for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


class ChatTemplate:
    """One model's template. `render` takes OpenAI-shaped messages (tool call arguments as
    objects, as the templates expect) and returns the prompt text."""

    def __init__(self, source: str | None, bos: str = "", eos: str = "", special_tokens: dict | None = None):
        self.source = source or DEFAULT_CHAT_TEMPLATE
        self.is_default = source is None
        try:
            self.tpl = environment().from_string(self.source)
        except Exception as e:   # jinja2 TemplateSyntaxError and friends
            raise FormatError(f"the model's chat template does not parse: {_one_line(e)}") from None
        self.bos, self.eos = bos, eos
        self.special_tokens = {"bos_token": bos, "eos_token": eos, **(special_tokens or {})}

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
               documents: list[dict] | None = None, **kwargs) -> str:
        """kwargs are the template's own switches (enable_thinking, reasoning_effort, ...); as in
        transformers they override the special tokens of the same name."""
        context = _plain({**self.special_tokens, **kwargs})
        try:
            return self.tpl.render(messages=template_messages(messages), tools=_plain(tools),
                                   documents=_plain(documents), add_generation_prompt=add_generation_prompt,
                                   **context)
        except RequestError:
            raise
        except Exception as e:
            raise RequestError(f"chat template failed on these messages: {type(e).__name__}: {_one_line(e)}") from None
