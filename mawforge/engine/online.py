"""Choosing among a few settings by measured speed, online: the one mechanism behind `auto`
speculation (spec or plain) and the compute-thread governor (how many threads the kernels use).
Pure Python, no clock of its own: callers pass the tokens a step emitted and the seconds it took.
"""
from __future__ import annotations

from typing import Hashable, Sequence


class OnlineChooser:
    """Picks one of `arms` per window of `window` tokens. Each arm's tokens/s is an exponential
    moving average over its windows. It explores every arm first (in the given order), then runs
    the fastest, re-probing the others one window in every `probe_every` (round robin), so a
    change (route locality, acceptance, a core taken by another program) is noticed."""

    def __init__(self, arms: Sequence[Hashable], window: int = 8, probe_every: int = 4, alpha: float = 0.5):
        if not arms or window < 1 or probe_every < 1:
            raise ValueError("need at least one arm, a positive window and a positive probe interval")
        self.arms, self.window, self.probe_every, self.alpha = tuple(arms), window, probe_every, alpha
        self.rate: dict = {a: None for a in self.arms}
        self.windows = {a: 0 for a in self.arms}
        self.current = self.arms[0]
        self._tokens, self._seconds, self._since_probe, self._probe = 0, 0.0, 0, 0
        self._queue: list = []

    def mode(self):
        return self.current

    def record(self, arm, tokens: int, seconds: float) -> None:
        self._tokens += tokens
        self._seconds += seconds
        if self._tokens < self.window:
            return
        rate = self._tokens / max(self._seconds, 1e-9)
        old = self.rate[arm]
        self.rate[arm] = rate if old is None else self.alpha * rate + (1 - self.alpha) * old
        self.windows[arm] += 1
        self._tokens, self._seconds = 0, 0.0
        self.current = self._next()

    def reprobe(self) -> None:
        """A new phase begins (a new request: other prompt, other routing, other read rate), so the
        rates measured so far may not hold: the windows after the current one measure every other
        arm once more before choosing again. Nothing changes while arms are still unexplored."""
        if all(self.rate[a] is not None for a in self.arms):
            self._queue = [a for a in self.arms if a != self.current]

    def _next(self):
        unknown = [a for a in self.arms if self.rate[a] is None]
        if unknown:
            return unknown[0]
        if self._queue:
            return self._queue.pop(0)
        best = max(self.arms, key=lambda a: self.rate[a])        # ties: the earlier arm
        others = [a for a in self.arms if a != best]
        self._since_probe += 1
        if others and self._since_probe >= self.probe_every:
            self._since_probe = 0
            self._probe += 1
            return others[(self._probe - 1) % len(others)]
        return best
