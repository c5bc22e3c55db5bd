"""The compute-thread governor: how many threads one-token decode steps use (torch's and the
native kernels'), chosen online by measured speed, so that decode follows the cores actually free.

On a 2-core machine with one core taken by another program, every OpenMP barrier waits for the
thread that lost its core: measured (benchmarks/busy.py, 8-layer shape-true file) two threads
keep 27-34% of their quiet speed where one thread keeps 57-59% of it. Quiet, two threads are 1.7x one.
So the governor explores each count, runs the fastest, and re-probes the others one window in
`probe_every` (the same OnlineChooser as `auto` speculation). It governs one-token decode steps
only, torch's threads and the native kernels' alike (torch's idle OpenMP workers spin and take
the free core otherwise: governing the kernels alone kept 0.28 of quiet speed, fixed 1 thread
0.57). A one-token step gives the same bits at any thread count (tested on every fixture
family, F32 to Q4_K_M: GEMVs and the native kernels split outputs, not sums); prefill and
verify steps are GEMMs that would not, so they always run at the full count (`release`).
The time measured is a step's wall time less its expert-read waits, so a cold cache does not
count against the thread count that met it.
"""
from __future__ import annotations

import torch

from mawforge.engine.online import OnlineChooser
from mawforge.kernels import native


class ThreadGovernor:
    def __init__(self, max_threads: int, window: int = 8, probe_every: int = 32) -> None:
        self.max_threads = max_threads
        self.chooser = OnlineChooser(tuple(range(max_threads, 0, -1)), window, probe_every)
        self.switches, self._last = 0, None

    @staticmethod
    def _set(n: int, limit: int | None) -> None:
        native.set_thread_limit(limit)
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)

    def before_step(self) -> int:
        """Before a one-token decode step: the count to run it with (set every step, since a
        draft model's governor in the same process shares both pools)."""
        n = self.chooser.mode()
        self.switches += self._last is not None and n != self._last
        self._last = n
        self._set(n, n)
        return n

    def after_step(self, threads: int, positions: int, compute_s: float) -> None:
        self.chooser.record(threads, positions, compute_s)

    def settled(self) -> bool:
        """True when every count has been measured and the step runs at the fastest one (not
        exploring, not probing): steps that other choosers may time without this one's probe
        in their figures (`--prefetch auto` times its windows only on such steps)."""
        c = self.chooser
        if any(c.rate[a] is None for a in c.arms):
            return False
        return c.current == max(c.arms, key=lambda a: c.rate[a])

    def release(self) -> None:
        """The full count, for steps whose bits would depend on it (prefill, verify)."""
        self._set(self.max_threads, None)

    def report(self) -> dict:
        c = self.chooser
        return {"threads": c.current, "switches": self.switches,
                "tok_s": {str(a): c.rate[a] for a in c.arms}, "windows": {str(a): c.windows[a] for a in c.arms}}

    def close(self) -> None:
        self.release()
