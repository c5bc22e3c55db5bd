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

Fewer threads only win when another program takes a core, and on a quiet machine a probe of
one thread costs its whole window (2 cores: that window runs at 0.6 of the speed, a quarter of
a 32-token request). So at every window the governor reads the CPU time the other processes
took (`CpuLoad`: /proc/stat's busy time less this process's own): while it stays under
QUIET_CORES the step runs at the full count with no exploring and no probing; when it rises,
the counts are measured afresh (rates from quiet windows do not hold under load) and chosen as
above. Where /proc/stat cannot be read, the governor always chooses by measured speed.
"""
from __future__ import annotations

import ctypes
import os
import time
from typing import Callable

import torch

from mawforge.engine.online import OnlineChooser
from mawforge.kernels import native


OMP_PAUSE_SOFT = 1


def release_openmp_pool() -> bool:
    """The calling thread hands the compute over to another thread (`serve`'s engine thread):
    its idle OpenMP workers exit. True when they did (or it had none).

    libgomp keeps a pool of workers for every thread that has started a parallel region, and
    counts them all together: once more of them exist than the CPUs it may use, every thread
    spins only ~100 times at a barrier before it sleeps in the kernel (config/linux/wait.h, the
    "throttled" spin count), so each of a decode step's hundreds of parallel regions pays a
    futex wake-up. torch and the native kernels share one libgomp (torch's), so a model loaded
    on the main thread and then run on an engine thread has two pools: on the AMD EPYC (Zen 4,
    2 cores, the 48-layer file, 2026-12-03) decode on the engine thread took 343 ms a token
    against 165 on the loading thread, and 135 once the loading thread's pool was released
    (omp_pause_resource_all, OpenMP 5.0; libgomp frees the calling thread's pool). The pool
    comes back if the thread computes again."""
    lib = _openmp_runtime()
    if lib is None:
        return False
    try:
        pause = lib.omp_pause_resource_all
    except AttributeError:
        return False
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    return pause(OMP_PAUSE_SOFT) == 0


def _openmp_runtime():
    """The OpenMP runtime this process has loaded (torch's libgomp, or an LLVM/Intel one), or None."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "/lib" in line}
    except OSError:
        return None
    for path in sorted(paths):
        name = os.path.basename(path)
        if name.startswith(("libgomp", "libiomp5", "libomp")) and ".so" in name:
            try:
                return ctypes.CDLL(path)      # already loaded: the same handle
            except OSError:
                continue
    return None


# other processes using less than this many cores over a window: a quiet machine
QUIET_CORES = 0.5


class CpuLoad:
    """`others()`: the cores other processes used since the previous call (the machine's busy
    CPU time from /proc/stat, less this process's own CPU time, over the wall time between),
    or None where /proc/stat cannot be read."""

    def __init__(self, stat: str = "/proc/stat") -> None:
        self.stat = stat
        self.tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._last = self._sample()

    def _sample(self) -> tuple[float, float, float] | None:
        try:
            with open(self.stat) as f:
                fields = f.readline().split()
        except OSError:
            return None
        if not fields or fields[0] != "cpu" or len(fields) < 5:
            return None
        j = [int(v) for v in fields[1:9]]
        busy = sum(j) - j[3] - (j[4] if len(j) > 4 else 0)           # less idle and iowait
        return time.monotonic(), busy / self.tick, time.process_time()

    def others(self) -> float | None:
        now = self._sample()
        last, self._last = self._last, now
        if now is None or last is None or now[0] <= last[0]:
            return None
        return max(0.0, ((now[1] - last[1]) - (now[2] - last[2])) / (now[0] - last[0]))


class ThreadGovernor:
    def __init__(self, max_threads: int, window: int = 8, probe_every: int = 32,
                 load: Callable[[], float | None] | None = None) -> None:
        """load: the cores other processes used since its previous call (None: unknown);
        default a CpuLoad over /proc/stat."""
        self.max_threads, self.window, self.probe_every = max_threads, window, probe_every
        self.chooser = self._new_chooser()
        self.switches, self._last = 0, None
        self.load = load if load is not None else CpuLoad().others
        self.quiet = False              # decided at the end of each window
        self.quiet_windows = self.busy_windows = 0
        self.others_cores: float | None = None
        self._tokens = 0

    def _new_chooser(self) -> OnlineChooser:
        return OnlineChooser(tuple(range(self.max_threads, 0, -1)), self.window, self.probe_every)

    @staticmethod
    def _set(n: int, limit: int | None) -> None:
        native.set_thread_limit(limit)
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)

    def before_step(self) -> int:
        """Before a one-token decode step: the count to run it with (set every step, since a
        draft model's governor in the same process shares both pools)."""
        if self._tokens == 0:
            self.load()                  # a window starts: the load is measured from here
        n = self.max_threads if self.quiet else self.chooser.mode()
        self.switches += self._last is not None and n != self._last
        self._last = n
        self._set(n, n)
        return n

    def after_step(self, threads: int, positions: int, compute_s: float) -> None:
        if not self.quiet:
            self.chooser.record(threads, positions, compute_s)
        self._tokens += positions
        if self._tokens < self.window:
            return
        self._tokens = 0                 # a window's end: is another program taking a core?
        others = self.others_cores = self.load()
        quiet = others is not None and others < QUIET_CORES
        if self.quiet and not quiet:
            self.chooser = self._new_chooser()      # measure every count afresh, under the load
        self.quiet = quiet
        if quiet:
            self.quiet_windows += 1
        else:
            self.busy_windows += 1

    def settled(self) -> bool:
        """True when every count has been measured and the step runs at the fastest one (not
        exploring, not probing): steps that other choosers may time without this one's probe
        in their figures (`--prefetch auto` times its windows only on such steps)."""
        c = self.chooser
        if self.quiet:
            return True
        if any(c.rate[a] is None for a in c.arms):
            return False
        return c.current == max(c.arms, key=lambda a: c.rate[a])

    def release(self) -> None:
        """The full count, for steps whose bits would depend on it (prefill, verify)."""
        self._set(self.max_threads, None)

    def report(self) -> dict:
        c = self.chooser
        return {"threads": self.max_threads if self.quiet else c.current, "switches": self.switches,
                "tok_s": {str(a): c.rate[a] for a in c.arms}, "windows": {str(a): c.windows[a] for a in c.arms},
                "quiet_windows": self.quiet_windows, "busy_windows": self.busy_windows,
                "others_cores": None if self.others_cores is None else round(self.others_cores, 3)}

    def close(self) -> None:
        self.release()
