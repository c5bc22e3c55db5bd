"""The model's tokens as a Responses API answer: output items (reasoning, message, function_call)
and the typed stream events in OpenAI's order, from ONE code path, so a streamed answer ends in
exactly the Response a non-streamed request gets.

    out = Output(rid, base, parser, summary=False)     # base: the Response fields echoed from the request
    events = out.start()                                # response.created, response.in_progress
    events += out.feed(token_text)                      # per token: item/part/delta events
    events += out.finish(finish_reason, telemetry)      # the .done events and the terminal event
    out.response                                        # the Response object (a dict)

An item opens with its first piece (text/outparse.py cuts the text into reasoning, content and
tool calls) and closes when a piece of another kind arrives or the output ends.
"""
from __future__ import annotations

import secrets
import time

from mawforge.text.outparse import OutputParser, ToolCall, argument_chunks

TERMINAL = {"completed": "response.completed", "incomplete": "response.incomplete",
            "failed": "response.failed", "cancelled": "response.failed"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def usage(prompt_tokens: int, completion_tokens: int, reasoning_tokens: int, cached_tokens: int = 0,
          cache_write_tokens: int = 0) -> dict:
    """OpenAI's usage; the cache counts stay 0 until the prompt cache reports them in telemetry."""
    return {"input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": cache_write_tokens},
            "output_tokens": completion_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt_tokens + completion_tokens}


def base_response(rid: str, model: str, echo: dict) -> dict:
    return {"id": rid, "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "model": model, "output": [], "error": None, "incomplete_details": None, "usage": None, **echo}


class Output:
    def __init__(self, rid: str, base: dict, parser: OutputParser, summary: bool = False):
        self.response, self.parser, self.summary = base, parser, summary
        self.items: list[dict] = []
        self.open: dict | None = None          # the item being written (a message or a reasoning item)
        self.text = ""                         # the open item's text so far
        self.seq = 0
        self.reasoning_tokens = 0

    # ---- events ----
    def _ev(self, kind: str, **fields) -> dict:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    def _snapshot(self) -> dict:
        return {**self.response, "output": [dict(i) for i in self.items]}

    def start(self) -> list[dict]:
        return [self._ev("response.created", response=self._snapshot()),
                self._ev("response.in_progress", response=self._snapshot())]

    def feed(self, text: str) -> list[dict]:
        before = self.parser.mode
        pieces = self.parser.feed(text)
        if "reasoning" in (before, self.parser.mode):      # the token was written inside a thought
            self.reasoning_tokens += 1
        return self._pieces(pieces)

    def finish(self, reason: str, telemetry, error: str | None = None, code: str = "server_error") -> list[dict]:
        """reason: the engine's finish_reason (stop, length, cancelled) or "failed" with `error`
        and its ResponseError code (server_error, or invalid_prompt for a request's own fault)."""
        events = self._pieces(self.parser.finish())          # held text is output too, even on failure
        if reason != "failed" and not self.items and self.open is None:
            events += self._open_message()                  # an empty answer is still a message
        status = {"stop": "completed", "length": "incomplete", "failed": "failed"}.get(reason, "cancelled")
        if self.open is not None:
            events += self._close("completed" if status == "completed" else "incomplete")
        r = self.response = self._snapshot()
        r["status"] = status
        if status == "completed":
            r["completed_at"] = int(time.time())
        if status == "incomplete":
            r["incomplete_details"] = {"reason": "max_output_tokens"}
        if status in ("failed", "cancelled"):
            r["error"] = {"code": code, "message": error or "the request was cancelled"}
        if telemetry is not None:
            r["usage"] = usage(telemetry.prompt_tokens, telemetry.completion_tokens, self.reasoning_tokens,
                               telemetry.cached_tokens)
            r["telemetry"] = telemetry.to_dict()
        return events + [self._ev(TERMINAL[status], response=r)]

    # ---- items ----
    def _pieces(self, pieces: list) -> list[dict]:
        events: list[dict] = []
        for p in pieces:
            if isinstance(p, ToolCall):
                events += self._close("completed") if self.open is not None else []
                events += self._call(p)
                continue
            kind, text = p
            want = "message" if kind == "content" else "reasoning"
            if self.open is not None and self.open["type"] != want:
                events += self._close("completed")
            if self.open is None:
                events += self._open_message() if want == "message" else self._open_reasoning()
            self.text += text
            idx = {"item_id": self.open["id"], "output_index": len(self.items) - 1, "content_index": 0}
            events.append(self._ev("response.output_text.delta", **idx, delta=text, logprobs=[]) if want == "message"
                          else self._ev("response.reasoning_text.delta", **idx, delta=text))
        return events

    def _add(self, item: dict) -> dict:
        self.items.append(item)
        return self._ev("response.output_item.added", output_index=len(self.items) - 1, item=dict(item))

    def _open_message(self) -> list[dict]:
        self.open, self.text = {"id": new_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                                "content": []}, ""
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [self._add(self.open), self._ev("response.content_part.added", item_id=self.open["id"],
                                               output_index=len(self.items) - 1, content_index=0, part=part)]

    def _open_reasoning(self) -> list[dict]:
        self.open, self.text = {"id": new_id("rs"), "type": "reasoning", "status": "in_progress", "summary": [],
                                "content": []}, ""
        part = {"type": "reasoning_text", "text": ""}
        return [self._add(self.open), self._ev("response.content_part.added", item_id=self.open["id"],
                                               output_index=len(self.items) - 1, content_index=0, part=part)]

    def _close(self, status: str) -> list[dict]:
        item, text, self.open = self.open, self.text, None
        idx = {"item_id": item["id"], "output_index": len(self.items) - 1}
        if item["type"] == "message":
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            events = [self._ev("response.output_text.done", **idx, content_index=0, text=text, logprobs=[])]
        else:
            part = {"type": "reasoning_text", "text": text}
            events = [self._ev("response.reasoning_text.done", **idx, content_index=0, text=text)]
        events.append(self._ev("response.content_part.done", **idx, content_index=0, part=part))
        item.update(content=[part], status=status)
        if item["type"] == "reasoning" and self.summary:
            s = {"type": "summary_text", "text": text}
            item["summary"] = [s]
            events += [self._ev("response.reasoning_summary_part.added", **idx, summary_index=0,
                                part={"type": "summary_text", "text": ""}),
                       self._ev("response.reasoning_summary_text.delta", **idx, summary_index=0, delta=text),
                       self._ev("response.reasoning_summary_text.done", **idx, summary_index=0, text=text),
                       self._ev("response.reasoning_summary_part.done", **idx, summary_index=0, part=s)]
        events.append(self._ev("response.output_item.done", output_index=len(self.items) - 1, item=dict(item)))
        return events

    def _call(self, call: ToolCall) -> list[dict]:
        item = {"id": new_id("fc"), "type": "function_call", "call_id": call.id, "name": call.name,
                "arguments": "", "status": "in_progress"}
        events = [self._add(item)]
        idx = {"item_id": item["id"], "output_index": len(self.items) - 1}
        events += [self._ev("response.function_call_arguments.delta", **idx, delta=a)
                   for a in argument_chunks(call.arguments)]
        events.append(self._ev("response.function_call_arguments.done", **idx, arguments=call.arguments))
        item.update(arguments=call.arguments, status="completed")
        events.append(self._ev("response.output_item.done", output_index=len(self.items) - 1, item=dict(item)))
        return events
