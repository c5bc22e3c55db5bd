"""A request's answer in OpenAI's shapes when it has several choices (`n`, a list of prompts),
logprobs or echo: the whole response, or its stream chunks, built from the engine worker's
(choice index, Event) items. One request's telemetry is `merge` of its choices'.

    shape = Answer(req, rid, model, tokenizer, turn, echo=[...])
    body = shape.whole(items)                       # non-streamed
    for item in items: chunks = shape.chunks(item)  # streamed (then "[DONE]")
"""
from __future__ import annotations

import copy
from dataclasses import replace

from mawforge.engine.processors import TokenLogprob
from mawforge.front import protocol as P
from mawforge.front.chatreq import finish_reason, shape_choice, stream_chunks
from mawforge.telemetry import Telemetry

_SUMMED = ("completion_tokens", "decode_s", "total_s", "hits", "misses", "evictions", "materialized_bytes",
           "prefetched_bytes", "prefetch_useful_bytes", "prefetch_wasted_bytes", "demand_load_s",
           "prefetch_stall_s", "prefill_read_bytes", "prefill_needed_bytes", "embedding_bytes_read")


def merge(tels: list[Telemetry], prompt_tokens: int, n: int = 1) -> Telemetry:
    """One request's telemetry from its choices' (n per prompt, in order): counters and times
    summed, each prompt counted once (usage; its cached tokens those of its first choice, as the
    later ones reuse the first's prefill), TTFT the first choice's, sizes and the finish reason the
    last one's."""
    if len(tels) == 1 and tels[0].prompt_tokens == prompt_tokens:
        return tels[0]
    out = replace(tels[-1], prompt_tokens=prompt_tokens, ttft_s=tels[0].ttft_s, prefill_s=tels[0].prefill_s,
                  cached_tokens=sum(t.cached_tokens for t in tels[::n]),
                  **{k: sum(getattr(t, k) for t in tels) for k in _SUMMED})
    out.miss_policy = {**tels[-1].miss_policy, **{k: sum(t.miss_policy[k] for t in tels)
                                                   for k in ("substituted", "skipped")}}
    out.hit_rate = out.hits / (out.hits + out.misses) if out.hits + out.misses else 0.0
    steps = out.completion_tokens - len(tels)
    out.decode_tok_s = steps / out.decode_s if steps > 0 and out.decode_s > 0 else 0.0
    return out


class Answer:
    def __init__(self, req: P.ApiRequest, rid: str, model: str, tokenizer, turn=None, echo: list[str] | None = None):
        self.req, self.rid, self.model, self.tok = req, rid, model, tokenizer
        self.kind, self.created = req.kind, P.now()
        self.total = req.n * max(1, len(req.prompts))
        # each choice reads its own output: one parser per choice, copied before any is fed
        self.parsers = None if turn is None else [turn.parser] + [copy.deepcopy(turn.parser)
                                                                  for _ in range(self.total - 1)]
        self.echo = echo                        # per prompt, when echo is asked
        self.offset = [0] * self.total          # completions' text_offset
        self.started = [False] * self.total

    def _prefix(self, i: int) -> str:
        return self.echo[i // self.req.n] if self.echo is not None else ""

    def last(self, i: int, ev) -> bool:
        """The request's last event (the worker stops after a cancelled choice)."""
        return ev.finish_reason is not None and (i == self.total - 1 or ev.finish_reason == "cancelled")

    # ---- logprobs ----
    def _entry(self, t: int, lp: float) -> dict:
        b = self.tok.token_bytes(t)
        return {"token": b.decode("utf-8", errors="backslashreplace"), "logprob": lp, "bytes": list(b)}

    def _logprobs(self, i: int, evs: list) -> dict | None:
        """Chat: {"content": [...], "refusal": None}; completions: tokens, token_logprobs,
        top_logprobs, text_offset (into the choice's text, echoed prompt included)."""
        lps: list[TokenLogprob] = [e.logprob for e in evs if e.logprob is not None]
        if self.req.params.logprobs is None:
            return None
        if self.kind == "chat":
            return {"content": [{**self._entry(x.token, x.logprob),
                                 "top_logprobs": [self._entry(t, v) for t, v in x.top]} for x in lps],
                    "refusal": None}
        offsets = []
        for e in evs:
            offsets.append(len(self._prefix(i)) + self.offset[i])
            self.offset[i] += len(e.text)
        return {"tokens": [self._entry(x.token, 0.0)["token"] for x in lps],
                "token_logprobs": [x.logprob for x in lps],
                "top_logprobs": [{self._entry(t, 0.0)["token"]: v for t, v in x.top} for x in lps],
                "text_offset": offsets}

    # ---- whole ----
    def whole(self, items: list) -> dict:
        by: list[list] = [[] for _ in range(self.total)]
        for i, ev in items:
            by[i].append(ev)
        tel = items[-1][1].telemetry
        body = P.response(self.kind, self.rid, self.created, self.model, "", tel.finish_reason,
                          P.usage(tel.prompt_tokens, tel.completion_tokens, tel.cached_tokens), tel.to_dict())
        body["choices"] = [self._choice(i, evs) for i, evs in enumerate(by) if evs]
        return body

    def _choice(self, i: int, evs: list) -> dict:
        texts, reason = [e.text for e in evs], evs[-1].finish_reason
        c = P._choice(self.kind, self._prefix(i) + "".join(texts), reason, False) | {"index": i}
        if self.parsers is not None:
            shape_choice(c, self.parsers[i], texts, reason)
        c["logprobs"] = self._logprobs(i, evs)
        return c

    # ---- streamed ----
    def chunks(self, item) -> list[dict]:
        """One event's chunks: its token's (with its logprobs on the first), then, when it ends a
        choice, the finish chunk, and after the request's last, the usage chunk if asked. The last
        chunk carries the request's telemetry."""
        i, ev = item
        kind, rid, created, model = self.kind, self.rid, self.created, self.model
        role = not self.started[i]
        self.started[i] = True
        text = (self._prefix(i) if role else "") + ev.text
        if self.parsers is None:
            out = [P.chunk(kind, rid, created, model, text=text, role=role)]
        else:
            out = stream_chunks(P.chunk(kind, rid, created, model, text="", role=role), self.parsers[i],
                                ev.text, ev.finish_reason is not None)
        for c in out:
            c["choices"][0]["index"] = i
        out[0]["choices"][0]["logprobs"] = self._logprobs(i, [ev])
        if ev.finish_reason is None:
            return out
        last, t = self.last(i, ev), ev.telemetry
        reason = ev.finish_reason if self.parsers is None else finish_reason(ev.finish_reason, self.parsers[i].calls)
        usage_chunk = last and self.req.include_usage
        fin = P.chunk(kind, rid, created, model, finish=reason,
                      telemetry=t.to_dict() if last and not usage_chunk else None)
        fin["choices"][0]["index"] = i
        out.append(fin)
        if usage_chunk:
            out.append(P.chunk(kind, rid, created, model,
                               use=P.usage(t.prompt_tokens, t.completion_tokens, t.cached_tokens),
                               telemetry=t.to_dict(), choices=False))
        return out
