"""`--prefetch auto` (the default): prefetch on, measured against prefetch off, by wall clock.

Prefetch hides a read behind compute when it guesses right and costs a read (and maybe a
useful block's eviction) when it guesses wrong; which wins depends on the model, the budget and
the routing, so the runtime measures it. When it is on, the prefetch is router lookahead: layer
l+2's router applied to layer l's FFN input, issued before layer l's experts run (LOOKAHEAD,
engine/runtime.py). It goes through the cache's byte budget, and never evicts a block of the
layers from l to the one it is for (RouteDriver.lookahead): it is dropped instead. No
next-token prefetcher runs beside it: the previous token's experts are resident already
(`--prefetch confidence:0.2` still offers one).

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
    winning its off-probes cost 1/64 of the tokens in the end rather than 1/8.

    On is the prior: off is first measured after `probe_every` windows of on, not in the
    second window of a process. A cold cache misses most, which is where prefetch wins, and
    an early off-window cost a fresh process's first teacher-forced tokens inside 8 GiB a
    fifth of their speed (8 of 28 tokens at 3.1 against 4.2 tok/s).

    A phase change re-measures both states: when a window's expert reads per token (demand
    and prefetch, `read_bytes` of after_step) differ from the recent windows' by PHASE_FACTOR
    or more, the next window runs the other state: random tokens read some 20x more a token
    than greedy text after a prompt, and where little is read the router GEMVs cost more than
    prefetch hides, so a choice made in one phase need not hold in the next (RESULTS.md)."""

    PHASE_FACTOR = 4.0
    PHASE_FLOOR = 1 << 20        # reads below 1 MiB a token count as 1 MiB (no phase in noise)

    def __init__(self, window: int = 8, probe_every: int = 8, max_probe_every: int = 64) -> None:
        self.chooser = OnlineChooser(ARMS, window, probe_every, max_probe_every=max_probe_every,
                                     explore_after=probe_every)
        self.tokens = 0
        self.switches: list[dict] = []
        self.n_switches = 0
        self.phases = 0
        self._win_tokens, self._win_bytes, self._reads = 0, 0, None   # reads: recent bytes a token
        self._skip = 0                       # tokens of a request's start left out of the phase rule

    def before_step(self) -> bool:
        """Whether this one-token decode step prefetches."""
        return self.chooser.mode() == "on"

    def after_step(self, on: bool, positions: int, seconds: float, read_bytes: int | None = None) -> None:
        before = self.chooser.mode()
        phase = self._phase(positions, read_bytes) if read_bytes is not None else None
        self.chooser.record("on" if on else "off", positions, seconds)
        self.tokens += positions
        after = self.chooser.mode()
        if after != before:
            self._switched(after, phase or self._why(after))

    def _switched(self, to: str, why: str) -> None:
        self.n_switches += 1
        self.switches.append({"token": self.tokens, "to": to, "why": why})
        del self.switches[:-MAX_SWITCHES_KEPT]

    def new_request(self) -> None:
        """A request begins: its first window's reads are left out of the phase comparison (the
        first tokens after a prompt miss more than the rest: 60-70 MB a token against 5-13 in
        greedy text inside 8 GiB, which would call every request a new phase)."""
        self._win_tokens, self._win_bytes, self._skip = 0, 0, self.chooser.window

    def _phase(self, positions: int, read_bytes: int) -> str | None:
        """Per window of the chooser's length: compare its reads a token with the recent ones'.
        Returns the reason where they changed phase (both states are then measured again)."""
        if self._skip > 0:
            self._skip -= positions
            return None
        self._win_tokens += positions
        self._win_bytes += read_bytes
        if self._win_tokens < self.chooser.window:
            return None
        rate = max(self._win_bytes / self._win_tokens, self.PHASE_FLOOR)
        self._win_tokens, self._win_bytes = 0, 0
        old = self._reads
        if old is not None and max(rate / old, old / rate) >= self.PHASE_FACTOR:
            self.phases += 1
            self.chooser.reprobe(fresh=True)
            self._reads = rate
            return f"phase: expert reads {old / 1e6:.3g} -> {rate / 1e6:.3g} MB a token, both states measured again"
        self._reads = rate if old is None else 0.5 * rate + 0.5 * old
        return None

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
                "switches": self.n_switches, "recent_switches": list(self.switches), "phases": self.phases}
