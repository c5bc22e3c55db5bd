"""Tool-call and reasoning formats of the model families MawForge serves, one registry row each.

A format says which markers open and close a reasoning block and a tool-call region in the
model's output, and how a region's text becomes (name, arguments) pairs. The format is chosen
from the chat template's text (the template is what taught the model its format), so a pack
needs no extra configuration. text/outparse.py runs the markers over the token stream.

    fmt = detect(template_source)           # e.g. FORMATS["qwen-json"]
    fmt.parse(region_text, schemas)         # -> [(name, {args})], ValueError when malformed
"""
from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass
from typing import Callable

Call = tuple[str, dict]
Schemas = dict[str, dict]        # function name -> its JSON-schema "parameters"


@dataclass(frozen=True)
class ToolFormat:
    name: str
    detect: Callable[[str], bool]
    think: tuple[tuple[str, str], ...] = ()      # reasoning (open, close) markers
    open: tuple[str, ...] = ()                   # markers that open a tool-call region
    close: str | None = None                     # ... and the one that closes it (None: end of output)
    parse: Callable[[str, Schemas], list[Call]] | None = None
    drop: tuple[str, ...] = ()                   # protocol markers removed from the visible text
    at_start: str | None = None                  # a region also opens if the answer starts with this
    prefix: Callable[[str | None], str] = lambda name: ""   # text that opens a call (tool_choice)
    short_ids: bool = False                      # Mistral templates insist on 9-character ids
    tested: str = ""                             # the templates it was checked with (README)

    def new_id(self) -> str:
        if self.short_ids:
            return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
        return "call_" + secrets.token_hex(12)


def _json_object(text: str) -> dict:
    v = json.loads(text)
    if not isinstance(v, dict):
        raise ValueError("arguments are not a JSON object")
    return v


def _args(v) -> dict:
    """Arguments given as an object or as a JSON string holding one."""
    return _json_object(v) if isinstance(v, str) else v if isinstance(v, dict) else _json_object("null")


def _typed(value: str, schema: dict | None) -> object:
    """XML-style formats write every value as text: keep it text where the schema says string."""
    kind = (schema or {}).get("type")
    if kind == "string" or (isinstance(kind, list) and "string" in kind):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


def _props(schemas: Schemas, name: str) -> dict:
    return (schemas.get(name) or {}).get("properties") or {}


# ---- region parsers: region text -> calls; any exception means "malformed, return as text" ----

def parse_json_call(region: str, schemas: Schemas) -> list[Call]:
    """Hermes/Qwen `{"name": ..., "arguments": {...}}` and Llama 3 `{"name": ..., "parameters": ...}`."""
    obj = _json_object(region.strip())
    args = obj["arguments"] if "arguments" in obj else obj["parameters"]
    return [(obj["name"], _args(args))]


def parse_qwen_xml(region: str, schemas: Schemas) -> list[Call]:
    """Qwen3.5 / Qwen3-Coder: <function=NAME><parameter=KEY>\nVALUE\n</parameter></function>."""
    calls = []
    for name, body in re.findall(r"<function=([^>\n]+)>(.*?)</function>", region, re.S):
        props = _props(schemas, name)
        params = re.findall(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", body, re.S)
        calls.append((name.strip(), {k.strip(): _typed(v, props.get(k.strip())) for k, v in params}))
    if not calls:
        raise ValueError("no <function=...> block")
    return calls


def parse_glm(region: str, schemas: Schemas) -> list[Call]:
    """GLM 4.x: NAME\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>..."""
    name = region.split("<arg_key>", 1)[0].strip()
    if not name or any(c.isspace() for c in name):
        raise ValueError("bad function name")
    props = _props(schemas, name)
    pairs = re.findall(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", region, re.S)
    return [(name, {k.strip(): _typed(v, props.get(k.strip())) for k, v in pairs})]


def parse_deepseek(region: str, schemas: Schemas) -> list[Call]:
    """V3.1: <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{json}<｜tool▁call▁end｜>; V3-0324/R1:
    <｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{json}\n```<｜tool▁call▁end｜>."""
    calls = []
    pattern = r"<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)<｜tool▁call▁end｜>"
    for head, body in re.findall(pattern, region, re.S):
        fenced = re.fullmatch(r"([^\n]+)\n```(?:json)?\n(.*?)\n?```\s*", body, re.S)
        if head.strip() == "function" and fenced:
            calls.append((fenced.group(1).strip(), _json_object(fenced.group(2))))
        else:
            calls.append((head.strip(), _json_object(body)))
    if not calls:
        raise ValueError("no tool call")
    return calls


def parse_dsml(region: str, schemas: Schemas) -> list[Call]:
    """DeepSeek V3.2/V4: <｜DSML｜invoke name="N"><｜DSML｜parameter name="K" string="true|false">V</...>."""
    calls = []
    for name, body in re.findall(r'<｜DSML｜invoke name="([^"]+)">(.*?)</｜DSML｜invoke>', region, re.S):
        params = re.findall(r'<｜DSML｜parameter name="([^"]+)" string="(true|false)">(.*?)</｜DSML｜parameter>',
                            body, re.S)
        calls.append((name, {k: v if s == "true" else json.loads(v) for k, s, v in params}))
    if not calls:
        raise ValueError("no invoke block")
    return calls


def parse_harmony(region: str, schemas: Schemas) -> list[Call]:
    """gpt-oss: after ` to=functions.`: NAME<|channel|>commentary json<|message|>{json}
    or NAME <|constrain|>json<|message|>{json}."""
    m = re.match(r"([\w.\-]+)", region)
    if not m or "<|message|>" not in region:
        raise ValueError("no recipient or message")
    return [(m.group(1), _json_object(region.split("<|message|>", 1)[1].strip()))]


def parse_mistral(region: str, schemas: Schemas) -> list[Call]:
    """Nemo: [TOOL_CALLS][{"name", "arguments", "id"}, ...]; Small 3.2 and later:
    [TOOL_CALLS]NAME[ARGS]{json} (optionally NAME[CALL_ID]ID[ARGS]{json}), repeated."""
    text = region.strip()
    if text.startswith("["):
        items = json.loads(text)
        if not isinstance(items, list) or not items:
            raise ValueError("not a list of calls")
        return [(it["name"], _args(it["arguments"])) for it in items]
    calls = []
    for part in filter(None, (p.strip() for p in text.split("[TOOL_CALLS]"))):
        head, args = part.split("[ARGS]", 1)
        calls.append((head.split("[CALL_ID]", 1)[0].strip(), _json_object(args)))
    if not calls:
        raise ValueError("no call")
    return calls


class _GemmaReader:
    """Gemma 4's call syntax: call:NAME{key:value,...}, strings quoted by <|"|>, bare keys."""
    Q = '<|"|>'

    def __init__(self, text: str):
        self.s, self.i = text, 0

    def value(self):
        s, i = self.s, self.i
        if s.startswith(self.Q, i):
            j = s.index(self.Q, i + len(self.Q))
            self.i = j + len(self.Q)
            return s[i + len(self.Q):j]
        if s.startswith("{", i):
            return self.obj()
        if s.startswith("[", i):
            self.i += 1
            out = []
            while not self._eat("]"):
                out.append(self.value())
                self._eat(",")
            return out
        m = re.compile(r"[^,}\]]+").match(s, i)
        if not m:
            raise ValueError(f"bad value at {i}")
        self.i = m.end()
        return json.loads(m.group(0).strip())

    def obj(self) -> dict:
        self._need("{")
        out = {}
        while not self._eat("}"):
            key = self.value() if self.s.startswith(self.Q, self.i) else self._key()
            self._need(":")
            out[key] = self.value()
            self._eat(",")
        return out

    def _key(self) -> str:
        j = self.s.index(":", self.i)
        key, self.i = self.s[self.i:j].strip(), j
        return key

    def _eat(self, c: str) -> bool:
        if self.s.startswith(c, self.i):
            self.i += len(c)
            return True
        if self.i >= len(self.s):
            raise ValueError("unterminated")
        return False

    def _need(self, c: str) -> None:
        if not self._eat(c):
            raise ValueError(f"expected {c!r} at {self.i}")


def parse_gemma4(region: str, schemas: Schemas) -> list[Call]:
    m = re.match(r"\s*call:([\w.\-]+)", region)
    if not m:
        raise ValueError("no call:NAME")
    r = _GemmaReader(region)
    r.i = m.end()
    args = r.obj()
    if region[r.i:].strip():
        raise ValueError("text after the call")
    return [(m.group(1), args)]


def _has(*needles: str) -> Callable[[str], bool]:
    return lambda src: all(n in src for n in needles)


THINK = (("<think>", "</think>"),)
# Order matters: the first row whose detector matches the template wins.
FORMATS: dict[str, ToolFormat] = {f.name: f for f in (
    ToolFormat("gpt-oss", _has("<|channel|>", "<|message|>"), think=(("<|channel|>analysis<|message|>", "<|end|>"),),
               open=(" to=functions.",), close="<|call|>", parse=parse_harmony,
               drop=("<|start|>assistant", "<|channel|>final<|message|>", "<|channel|>commentary", "<|message|>",
                     "<|end|>", "<|return|>"),
               prefix=lambda n: "<|channel|>commentary to=functions." + (
                   f"{n} <|constrain|>json<|message|>" if n else ""),
               tested="openai-gpt-oss-120b"),
    ToolFormat("gemma4", _has("<|tool_call>"), think=(("<|channel>thought", "<channel|>"),), open=("<|tool_call>",),
               close="<tool_call|>", parse=parse_gemma4, drop=("<|tool_response>", "<turn|>"),
               prefix=lambda n: "<|tool_call>call:" + (f"{n}{{" if n else ""),
               tested="google-gemma-4-31B-it, google-gemma-4-31B-it-interleaved"),
    ToolFormat("deepseek-dsml", _has("DSML"), think=THINK, open=("<｜DSML｜function_calls>",),
               close="</｜DSML｜function_calls>", parse=parse_dsml, drop=("<｜end▁of▁sentence｜>",),
               prefix=lambda n: '<｜DSML｜function_calls>\n<｜DSML｜invoke name="' + (f'{n}">\n' if n else ""),
               tested="deepseek-ai-DeepSeek-V3.2, deepseek-ai-DeepSeek-V4, deepseek-ai-DeepSeek-V4-Flash-0731"),
    ToolFormat("deepseek", _has("tool▁call▁begin"), think=THINK, open=("<｜tool▁calls▁begin｜>",),
               close="<｜tool▁calls▁end｜>", parse=parse_deepseek, drop=("<｜end▁of▁sentence｜>",),
               prefix=lambda n: "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>" + (
                   f"{n}<｜tool▁sep｜>" if n else ""),
               tested="deepseek-ai-DeepSeek-V3.1, deepseek-ai-DeepSeek-R1-Distill-*, llama-cpp-deepseek-r1"),
    ToolFormat("glm", _has("<arg_key>"), think=THINK, open=("<tool_call>",), close="</tool_call>", parse=parse_glm,
               prefix=lambda n: "<tool_call>" + (f"{n}\n" if n else ""), tested="GLM-4.6, GLM-4.7-Flash"),
    ToolFormat("qwen-xml", _has("<tool_call>", "<function="), think=THINK, open=("<tool_call>",),
               close="</tool_call>", parse=parse_qwen_xml,
               prefix=lambda n: "<tool_call>\n<function=" + (f"{n}>\n" if n else ""),
               tested="Qwen3.5-4B (Qwen3.5/3.6), Qwen3-Coder"),
    ToolFormat("qwen-json", _has("<tool_call>"), think=THINK, open=("<tool_call>",), close="</tool_call>",
               parse=parse_json_call,
               prefix=lambda n: "<tool_call>\n" + (f'{{"name": "{n}", "arguments": ' if n else ""),
               tested="Qwen-Qwen3-0.6B (Qwen3), Qwen-Qwen2.5-7B-Instruct, Qwen-QwQ-32B"),
    ToolFormat("mistral", _has("[TOOL_CALLS]", "[ARGS]"), think=(("[THINK]", "[/THINK]"),), open=("[TOOL_CALLS]",),
               parse=parse_mistral, drop=("</s>",), short_ids=True,
               prefix=lambda n: "[TOOL_CALLS]" + (f"{n}[ARGS]" if n else ""),
               tested="Mistral-Small-3.2-24B-Instruct-2506, mistralai-Ministral-3-14B-Reasoning-2512, "
                      "unsloth-mistral-Devstral-Small-2507"),
    ToolFormat("mistral-json", _has("[TOOL_CALLS]"), open=("[TOOL_CALLS]",), parse=parse_mistral, drop=("</s>",),
               short_ids=True, prefix=lambda n: "[TOOL_CALLS][" + (f'{{"name": "{n}", "arguments": ' if n else ""),
               tested="mistralai-Mistral-Nemo-Instruct-2407 (Mixtral-era JSON list)"),
    ToolFormat("llama3", _has("<|start_header_id|>", '"parameters": '), open=("<|python_tag|>",),
               parse=parse_json_call, at_start="{", drop=("<|eom_id|>", "<|eot_id|>"),
               prefix=lambda n: '{"name": "' + (f'{n}", "parameters": ' if n else ""),
               tested="meta-llama-Llama-3.1-8B-Instruct, Llama-3.2-3B-Instruct, Llama-3.3-70B-Instruct"),
    ToolFormat("think", _has("</think>"), think=THINK, tested="reasoning only"),
    ToolFormat("plain", lambda src: True, tested="no markers: the text is the answer"),
)}


def detect(template_source: str) -> ToolFormat:
    return next(f for f in FORMATS.values() if f.detect(template_source))
