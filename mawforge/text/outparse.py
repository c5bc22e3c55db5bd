"""The model's output split into what OpenAI clients expect: reasoning, content and tool calls,
token by token, so streaming and non-streaming answers are cut at the same places.

    p = OutputParser(fmt, schemas, reasoning=True, tools=True, start_in_reasoning=...)
    for text in token_texts: pieces += p.feed(text)        # [("content"|"reasoning", str) | ToolCall]
    pieces += p.finish()

Text that could be the start of a marker is held back until it is decided. Inside a tool-call
region nothing is shown until the region closes (or the output ends); then the region is parsed,
and if that fails, or names a function the request did not offer, the raw text is returned as
content: a malformed call is the model's answer, not a server error.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from mawforge.text.tools import ToolFormat


@dataclass(frozen=True)
class ToolCall:
    index: int
    id: str
    name: str
    arguments: str           # a JSON object, as a string (OpenAI's wire format)

    def message(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _held_prefix(text: str, markers) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some marker."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:n]):
                best = n
                break
    return best


class OutputParser:
    def __init__(self, fmt: ToolFormat, schemas: dict[str, dict] | None = None, *, reasoning: bool = True,
                 tools: bool = True, start_in_reasoning: bool = False):
        self.fmt, self.schemas = fmt, schemas or {}
        self.think = fmt.think if reasoning else ()
        self.opens = (fmt.open if tools and fmt.parse else ())
        self.at_start = fmt.at_start if tools and fmt.parse else None
        self.active = bool(self.think or self.opens or fmt.drop)
        self.mode, self.close = "content", None
        if start_in_reasoning and self.think:
            self.mode, self.close = "reasoning", self.think[0][1]
        self.pending = self.held = self.region = self.region_open = ""
        self.fresh = self.mode == "reasoning"      # strip the whitespace that starts a segment
        self.started = False                       # any visible content yet (for at_start)
        self.calls: list[ToolCall] = []

    # ---- public ----
    def feed(self, text: str) -> list:
        if not self.active:
            return [("content", text)] if text else []
        self.pending += text
        out: list = []
        while self.pending and self._step(out):
            pass
        return out

    def finish(self) -> list:
        out: list = []
        if not self.active:
            return out
        if self.mode == "tool":
            self.region += self.pending
            self.pending = ""
            out += self._close_region(None)
        else:
            text, self.pending = self.pending, ""
            out += self._text(text)
        if self.mode == "content" and self.held:
            out.append(("content", self.held))
        self.held = ""
        return out

    # ---- scanning ----
    def _markers(self) -> list[tuple[str, str, str | None]]:
        """(marker, action, close) for the current mode; action: reasoning|content|tool|drop."""
        if self.mode == "reasoning":
            return [(self.close, "content", None)]
        return ([(o, "reasoning", c) for o, c in self.think] + [(o, "tool", self.fmt.close) for o in self.opens]
                + [(d, "drop", None) for d in self.fmt.drop])

    def _step(self, out: list) -> bool:
        """Consume what can be decided now; False when the rest must wait for more text."""
        if self.mode == "tool":
            return self._step_region(out)
        if self.mode == "content" and self.at_start and not self.started:
            lead = self.pending.lstrip()
            if not lead:
                return False
            if lead.startswith(self.at_start):
                self.mode, self.close, self.region_open = "tool", None, self.held + self.pending[:-len(lead)]
                self.held, self.region, self.pending = "", lead, ""
                return False
        markers = self._markers()
        hits = [(self.pending.find(m), -len(m), m, act, close) for m, act, close in markers if m in self.pending]
        if not hits:
            keep = _held_prefix(self.pending, [m for m, _, _ in markers])
            text, self.pending = self.pending[:len(self.pending) - keep], self.pending[len(self.pending) - keep:]
            out += self._text(text)
            return False
        i, _, m, act, close = min(hits, key=lambda h: h[:2])     # earliest, then longest
        out += self._text(self.pending[:i])
        self.pending = self.pending[i + len(m):]
        if act == "drop":
            return True
        if act == "tool":                        # kept in case the region turns out malformed
            self.region_open, self.region = self.held + m, ""
        self.held = ""                           # whitespace before a block is layout, not answer
        self.mode, self.close, self.fresh = act, close, True
        return True

    def _step_region(self, out: list) -> bool:
        if self.close is None:
            self.region += self.pending
            self.pending = ""
            return False
        i = self.pending.find(self.close)
        if i < 0:
            keep = _held_prefix(self.pending, [self.close])
            self.region += self.pending[:len(self.pending) - keep]
            self.pending = self.pending[len(self.pending) - keep:]
            return False
        self.region += self.pending[:i]
        self.pending = self.pending[i + len(self.close):]
        out += self._close_region(self.close)
        return True

    def _text(self, text: str) -> list:
        if not text:
            return []
        text, self.held = self.held + text, ""
        if self.fresh:
            text = text.lstrip()
            if not text:
                return []
            self.fresh = False
        body = text.rstrip()
        self.held = text[len(body):]
        if not body:
            return []
        if self.mode == "content":
            self.started = True
        return [(self.mode, body)]

    def _close_region(self, close: str | None) -> list:
        raw = self.region_open + self.region + (close or "")
        self.mode, self.close, self.fresh = "content", None, True
        region, self.region = self.region, ""
        try:
            calls = self.fmt.parse(region, self.schemas)
            if not calls or any(not isinstance(n, str) or not isinstance(a, dict) or
                                (self.schemas and n not in self.schemas) for n, a in calls):
                raise ValueError("unknown function or bad arguments")
        except Exception:                # malformed: the model's text, as it wrote it
            self.started = True
            self.fresh = False
            return [("content", raw)]
        made = []
        for name, args in calls:
            call = ToolCall(len(self.calls), self.fmt.new_id(), name, json.dumps(args, ensure_ascii=False))
            self.calls.append(call)
            made.append(call)
        return made


def collect(pieces: list) -> tuple[str | None, str | None, list[ToolCall]]:
    """Whole-answer view: (content, reasoning_content, tool_calls)."""
    content = "".join(p[1] for p in pieces if isinstance(p, tuple) and p[0] == "content")
    reasoning = "".join(p[1] for p in pieces if isinstance(p, tuple) and p[0] == "reasoning")
    calls = [p for p in pieces if isinstance(p, ToolCall)]
    return content, reasoning or None, calls


def argument_chunks(arguments: str, size: int = 16) -> list[str]:
    """How a call's arguments go out in a stream: in pieces after the header, as OpenAI sends them."""
    return [arguments[i:i + size] for i in range(0, len(arguments), size)] or [""]
