"""The logits processors that OpenAI's sampling fields ask for, on Sampler.processors
(engine/sampling.py): each is called with the logits of the next position ([V] -> [V], never in
place), and follows the request's emitted tokens through accept(token) / rollback(n).

    LogprobRecorder   logprobs / top_logprobs: keeps the raw logits of each position it sees
    LogitBias         logit_bias: logit[j] += bias[j]
    Penalties         presence / frequency: logit[j] -= count[j] * frequency + (count[j] > 0) * presence,
                      count over the tokens this choice generated so far (OpenAI's definition)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log-probability under the model, and the `top` most likely tokens
    at its position (id, logprob), most likely first."""
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class LogprobRecorder:
    """First in the list, so it sees the raw model logits (before bias, penalties, grammar or
    temperature). It only keeps a reference per position; the log-softmax is computed for the
    emitted token alone, by take(). Speculative verification calls it for each position it
    checks (the verify forward's logits), so logprobs come from the logits that chose the token."""

    def __init__(self, top: int):
        self.top, self.pos, self.seen = top, 0, {}

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        self.seen[self.pos] = logits
        return logits

    def accept(self, token: int) -> None:
        self.pos += 1

    def rollback(self, n: int) -> None:
        self.pos -= n

    def take(self, token: int) -> TokenLogprob:
        """The last accepted token's logprob (call right after Sampler.accept(token))."""
        at = self.pos - 1
        lp = torch.log_softmax(self.seen.pop(at).float(), dim=-1)          # [V]
        for p in [p for p in self.seen if p < at]:
            del self.seen[p]
        top = ()
        if self.top:
            vals, idx = torch.topk(lp, min(self.top, lp.numel()))
            top = tuple(zip(idx.tolist(), vals.tolist()))
        return TokenLogprob(token, float(lp[token]), top)


class LogitBias:
    def __init__(self, bias: tuple[tuple[int, float], ...]):
        self.ids = torch.tensor([t for t, _ in bias], dtype=torch.long)
        self.vals = torch.tensor([b for _, b in bias], dtype=torch.float32)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.index_add(0, self.ids.to(logits.device), self.vals.to(logits.device, logits.dtype))

    def accept(self, token: int) -> None:
        pass

    def rollback(self, n: int) -> None:
        pass


class Penalties:
    def __init__(self, presence: float, frequency: float):
        self.presence, self.frequency = presence, frequency
        self.counts: dict[int, int] = {}
        self.tokens: list[int] = []

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.counts:
            return logits
        ids = torch.tensor(list(self.counts), dtype=torch.long, device=logits.device)
        n = torch.tensor(list(self.counts.values()), dtype=torch.float32, device=logits.device)
        return logits.index_add(0, ids, (-(n * self.frequency + self.presence)).to(logits.dtype))

    def accept(self, token: int) -> None:
        self.tokens.append(token)
        self.counts[token] = self.counts.get(token, 0) + 1

    def rollback(self, n: int) -> None:
        for _ in range(n):
            t = self.tokens.pop()
            self.counts[t] -= 1
            if not self.counts[t]:
                del self.counts[t]


def for_params(p) -> tuple[LogprobRecorder | None, list]:
    """The processors a SamplingParams asks for, recorder first; nothing when none is asked."""
    rec = LogprobRecorder(p.logprobs) if p.logprobs is not None else None
    procs = [rec] if rec is not None else []
    if p.logit_bias:
        procs.append(LogitBias(p.logit_bias))
    if p.presence_penalty or p.frequency_penalty:
        procs.append(Penalties(p.presence_penalty, p.frequency_penalty))
    return rec, procs
