"""Sampling: greedy, temperature, top-k, top-p, min-p, with a seeded generator per request.

Logits processors (logit bias, penalties, a grammar's token mask, ...) run before every filter,
in order, on the logits of the next position; each keeps its own per-request state, advanced by
`accept(token)` for every token the request emits and undone by `rollback(n)` (speculative
verification advances through the drafts it checks, then rolls them back).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from mawforge.engine.processors import for_params
from mawforge.errors import RequestError

MAX_LOGPROBS = 20              # OpenAI's top_logprobs bound


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 96
    temperature: float = 0.0        # 0 = greedy
    top_k: int = 0                  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Testing hook (serve --allow-forced-output): these tokens are emitted in order instead of
    # sampled ones, while the model still runs every step, so the whole path is real but the text.
    forced_tokens: tuple[int, ...] = ()
    # OpenAI's fields, applied by the processors in engine/processors.py
    logprobs: int | None = None     # None: off; k: the emitted token's logprob and the top k at its position
    logit_bias: tuple[tuple[int, float], ...] = ()      # (token id, bias)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise RequestError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 5.0:
            raise RequestError(f"temperature must be in [0, 5], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p < 1.0:
            raise RequestError(f"min_p must be in [0, 1), got {self.min_p}")
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0, got {self.top_k}")
        if self.seed is not None and not -2**63 <= self.seed < 2**64:
            raise RequestError(f"seed must be a 64-bit integer, got {self.seed}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise RequestError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise RequestError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        for t, b in self.logit_bias:
            if t < 0 or not -100.0 <= b <= 100.0:
                raise RequestError(f"logit_bias must map token ids to biases in [-100, 100], got {t}: {b}")

    def for_choice(self, i: int) -> "SamplingParams":
        """Choice i of a request with n choices: its own seed, derived from the request's (choice 0
        keeps it, so n = 1 is unchanged); unseeded choices draw their own seeds anyway."""
        if i == 0 or self.seed is None:
            return self
        return replace(self, seed=(self.seed * 0x9E3779B97F4A7C15 + i) % 2**63)


class LogitsProcessor(Protocol):
    def __call__(self, logits: torch.Tensor) -> torch.Tensor: ...     # [V] -> [V], for the next position
    def accept(self, token: int) -> None: ...                          # the request emitted token
    def rollback(self, n: int) -> None: ...                            # undo the last n accepts


@dataclass
class Sampler:
    params: SamplingParams
    processors: list = field(default_factory=list)     # LogitsProcessor, applied in order
    gen: torch.Generator = field(init=False)

    def __post_init__(self) -> None:
        self.gen = torch.Generator()
        self.gen.manual_seed(self.params.seed if self.params.seed is not None else torch.seed())
        self.n_forced = 0
        self.logprobs, asked = for_params(self.params)      # the recorder (or None), then bias and penalties
        self.processors = asked + list(self.processors)

    @property
    def greedy(self) -> bool:
        return self.params.temperature == 0.0

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits after every processor, for the next position. [V] -> [V]"""
        for proc in self.processors:
            logits = proc(logits)
        return logits

    def accept(self, token: int) -> None:
        for proc in self.processors:
            proc.accept(token)

    @property
    def done(self) -> bool:
        """A processor says the output is complete (a grammar in its final state)."""
        return any(getattr(proc, "done", False) for proc in self.processors)

    def rollback(self, n: int) -> None:
        if n:
            for proc in self.processors:
                proc.rollback(n)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution actually sampled from, after every processor and filter. logits [V] -> [V] f32."""
        p = self.params
        x = self.process(logits.float().cpu())
        if self.greedy:
            out = torch.zeros_like(x)
            out[int(torch.argmax(x))] = 1.0
            return out
        x = x / p.temperature
        if p.top_k:
            kth = torch.topk(x, min(p.top_k, x.numel())).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        probs = torch.softmax(x, dim=-1)
        if p.min_p > 0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        if p.top_p < 1.0:
            sp, si = torch.sort(probs, descending=True)
            keep = (sp.cumsum(0) - sp) < p.top_p      # keep the smallest prefix reaching top_p
            probs = torch.zeros_like(probs).scatter(0, si, sp * keep)
        return probs / probs.sum()

    def sample(self, logits: torch.Tensor) -> int:
        if self.n_forced < len(self.params.forced_tokens):
            self.n_forced += 1
            if self.processors:          # they follow every position (the logprob recorder keeps it)
                self.process(logits)
            return self.params.forced_tokens[self.n_forced - 1]
        if self.greedy:
            return int(torch.argmax(self.process(logits) if self.processors else logits))
        return int(torch.multinomial(self.probs(logits), 1, generator=self.gen))

    def draw(self, probs: torch.Tensor) -> int:
        return int(torch.multinomial(probs, 1, generator=self.gen))

    def uniform(self) -> float:
        return float(torch.rand(1, generator=self.gen))
