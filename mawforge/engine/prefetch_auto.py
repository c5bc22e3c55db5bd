"""`--prefetch auto` (the default): prefetch on, measured against prefetch off, by wall clock.

Prefetch hides a read behind compute when it guesses right and costs a read (and maybe a
useful block's eviction) when it guesses wrong; which wins depends on the model, the budget and
the routing, so the runtime measures it. When it is on, the prefetch is router lookahead: layer
l+2's router applied to layer l's FFN input, issued before layer l's experts run (LOOKAHEAD,
engine/runtime.py). It goes through the cache's byte budget, and never evicts a block of the
layers from l to the one it is for (RouteDriver.lookahead): it is dropped instead. (The
next-token prefetcher `confidence:0.2`, the previous token's experts with weight >= 0.2, ran
beside it until replays of full-size traces showed it changed no byte read: those experts are
resident already. It is still there as `--prefetch confidence:0.2`.)

One-token decode steps alternate windows of prefetch on and off through the same OnlineChooser
as the thread governor and `auto` speculation, timed by whole-step wall time (reads included:
hiding them is the point). Prefill and verify steps always prefetch (a chunk needs most of a
layer's experts, so a lookahead is nearly always right). `report()` is the request telemetry's
`prefetch` field: the state, each arm's tokens/s, and every switch with the token it happened at
and why. Route traces record each step's state and each lookahead's keys, so replay reproduces
the live cache's counters exactly.
"""
from __future__ import annotations

from mawforge.engine.online import OnlineChooser

AUTO_PREFETCHER = None       # no per-layer prefetcher beside the lookahead (see above)
ARMS = ("on", "off")
MAX_SWITCHES_KEPT = 16


class PrefetchGovernor:
    """probe_every: windows between probes of the losing state at first; each probe that leaves
    the choice as it was doubles it, up to max_probe_every (OnlineChooser), so with prefetch
    winning its off-probes cost 1/64 of the tokens in the end rather than 1/8."""

    def __init__(self, window: int = 8, probe_every: int = 8, max_probe_every: int = 64) -> None:
        self.chooser = OnlineChooser(ARMS, window, probe_every, max_probe_every=max_probe_every)
        self.tokens = 0
        self.switches: list[dict] = []
        self.n_switches = 0

    def before_step(self) -> bool:
        """Whether this one-token decode step prefetches."""
        return self.chooser.mode() == "on"

    def after_step(self, on: bool, positions: int, seconds: float) -> None:
        before = self.chooser.mode()
        self.chooser.record("on" if on else "off", positions, seconds)
        self.tokens += positions
        after = self.chooser.mode()
        if after != before:
            self.n_switches += 1
            self.switches.append({"token": self.tokens, "to": after, "why": self._why(after)})
            del self.switches[:-MAX_SWITCHES_KEPT]

    def _why(self, to: str) -> str:
        rate = self.chooser.rate
        if rate[to] is None:
            return f"exploring: {to} not measured yet"
        other = "off" if to == "on" else "on"
        if rate[other] is not None and rate[to] < rate[other]:
            return f"probe: {to} measured {rate[to]:.3g} tok/s, {other} {rate[other]:.3g}"
        other_s = f"{rate[other]:.3g}" if rate[other] is not None else "unmeasured"
        return f"faster: {to} {rate[to]:.3g} tok/s against {other} {other_s}"

    def report(self) -> dict:
        c = self.chooser
        return {"mode": "auto", "state": c.current, "prefetcher": AUTO_PREFETCHER, "lookahead": True,
                "tok_s": {a: c.rate[a] for a in c.arms}, "windows": dict(c.windows), "probe_every": c.interval,
                "switches": self.n_switches, "recent_switches": list(self.switches)}
