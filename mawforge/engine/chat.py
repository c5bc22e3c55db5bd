"""Chat templates rendered the way Hugging Face `transformers` renders them, so a prompt built here
is byte-for-byte the prompt the model was trained and evaluated with.

transformers (`utils/chat_template_utils.py`) compiles every template in an
ImmutableSandboxedEnvironment(trim_blocks, lstrip_blocks) with the `loopcontrols` extension and a
`{% generation %}` tag, replaces jinja's `tojson` (which sorts keys and HTML-escapes) with plain
`json.dumps(x, ensure_ascii=False, indent, separators, sort_keys=False)`, adds the globals
`raise_exception` and `strftime_now`, and renders with `messages`, `tools`, `documents` and
`add_generation_prompt` always defined (None when absent) plus the tokenizer's special tokens and
any extra keyword (`enable_thinking`, `reasoning_effort`, ...). Each of those details changes the
output of some real template (Llama 3.1 `tojson(indent=4)`, Gemma 4 key order, gpt-oss dates,
Mistral `tools is defined`); tests/test_chat_templates.py checks them against transformers itself.
"""
from __future__ import annotations

import json
from datetime import datetime

from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

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


def _raise(msg: str):
    raise RequestError(f"the chat template refused these messages: {msg}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """One model's template. `render` takes OpenAI-shaped messages (tool call arguments as
    objects, as the templates expect) and returns the prompt text."""

    def __init__(self, source: str | None, bos: str = "", eos: str = "", special_tokens: dict | None = None):
        self.source = source or DEFAULT_CHAT_TEMPLATE
        self.is_default = source is None
        try:
            self.tpl = environment().from_string(self.source)
        except Exception as e:   # jinja2 TemplateSyntaxError and friends
            raise FormatError(f"the model's chat template does not parse: {e}") from None
        self.bos, self.eos = bos, eos
        self.special_tokens = {"bos_token": bos, "eos_token": eos, **(special_tokens or {})}

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
               documents: list[dict] | None = None, **kwargs) -> str:
        """kwargs are the template's own switches (enable_thinking, reasoning_effort, ...); as in
        transformers they override the special tokens of the same name."""
        context = {**self.special_tokens, **kwargs}
        try:
            return self.tpl.render(messages=messages, tools=tools, documents=documents,
                                   add_generation_prompt=add_generation_prompt, **context)
        except RequestError:
            raise
        except Exception as e:
            raise RequestError(f"chat template failed on these messages: {type(e).__name__}: {e}") from None
