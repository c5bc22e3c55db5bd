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
    change (route locality, acceptance, a core taken by another program) is noticed.

    With `max_probe_every`, a probe that leaves the choice as it was doubles the interval, up
    to that many windows, and a probe that changes it (or `reprobe`) restores `probe_every`:
    while one arm keeps winning, its probes cost ever fewer of the tokens.

    With `explore_after`, the first arm is the prior: the others are first explored after it
    has run that many windows (a probe's distance), not in the second window of all."""

    def __init__(self, arms: Sequence[Hashable], window: int = 8, probe_every: int = 4, alpha: float = 0.5,
                 max_probe_every: int | None = None, explore_after: int = 0):
        if not arms or window < 1 or probe_every < 1 or (max_probe_every is not None and max_probe_every < probe_every):
            raise ValueError("need at least one arm, a positive window and a positive probe interval "
                             "(no larger than the largest)")
        self.arms, self.window, self.probe_every, self.alpha = tuple(arms), window, probe_every, alpha
        self.max_probe_every = max_probe_every or probe_every
        self.explore_after = explore_after
        self.interval = probe_every     # windows between probes now
        self._probing = None            # the arm chosen before the probe window now running
        self.rate: dict = {a: None for a in self.arms}
        self.windows = {a: 0 for a in self.arms}
        self.current = self.arms[0]
        self._tokens, self._seconds, self._since_probe, self._probe = 0, 0.0, 0, 0
        self._queue: list = []
        self._fresh: set = set()        # arms whose next window replaces their average (reprobe)

    def mode(self):
        return self.current

    def record(self, arm, tokens: int, seconds: float) -> None:
        self._tokens += tokens
        self._seconds += seconds
        if self._tokens < self.window:
            return
        rate = self._tokens / max(self._seconds, 1e-9)
        old = None if arm in self._fresh else self.rate[arm]
        self._fresh.discard(arm)
        self.rate[arm] = rate if old is None else self.alpha * rate + (1 - self.alpha) * old
        self.windows[arm] += 1
        self._tokens, self._seconds = 0, 0.0
        self.current = self._next()

    def reprobe(self, fresh: bool = False) -> None:
        """A new phase begins (a new request: other prompt, other routing, other read rate), so the
        rates measured so far may not hold: the windows after the current one measure every other
        arm once more before choosing again. Nothing changes while arms are still unexplored.
        fresh: the phase is known to differ, so each arm's next window replaces its average
        instead of joining it (the current arm's included)."""
        if all(self.rate[a] is not None for a in self.arms):
            self._queue = [a for a in self.arms if a != self.current]
            self.interval = self.probe_every
            self._since_probe = 0
            if fresh:
                self._fresh = set(self.arms)

    def _next(self):
        unknown = [a for a in self.arms if self.rate[a] is None]
        if unknown:
            prior = self.arms[0]
            return prior if prior not in unknown and self.windows[prior] < self.explore_after else unknown[0]
        if self._queue:
            return self._queue.pop(0)
        best = max(self.arms, key=lambda a: self.rate[a])        # ties: the earlier arm
        if self._probing is not None:   # a probe window just ended: did it change the choice?
            kept = best == self._probing
            self.interval = min(2 * self.interval, self.max_probe_every) if kept else self.probe_every
            self._probing = None
        others = [a for a in self.arms if a != best]
        self._since_probe += 1
        if others and self._since_probe >= self.interval:
            self._since_probe = 0
            self._probe += 1
            self._probing = best
            return others[(self._probe - 1) % len(others)]
        return best
