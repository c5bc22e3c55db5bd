"""The memory guard: a thread samples the machine every 250 ms while a cell runs and stops the
cell's whole process tree when a threshold is crossed.

One sample: process-tree RSS (the server and every descendant, from /proc), the system used
ratio (1 - MemAvailable / MemTotal), the cgroup's usage when the cell runs in one, and
/proc/pressure/memory. A sample that fails to read is kept with its error; the largest gap
between good samples is reported, because a guard that stopped looking cannot claim a peak.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from mawforge.errors import FormatError

PAGE = os.sysconf("SC_PAGE_SIZE")


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:                  # the process ended while we looked
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        kids.setdefault(ppid, []).append(int(d))
    return kids


def process_tree(root: int) -> list[int]:
    """root and all its descendants that are alive now."""
    kids, out, todo = _children(), [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(kids.get(pid, ()))
    return out


def tree_rss_bytes(root: int) -> int:
    total = 0
    for pid in process_tree(root):
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * PAGE
        except OSError:
            pass
    return total


def kill_tree(root: int, sig: int = signal.SIGKILL) -> None:
    for pid in reversed(process_tree(root)):     # children first, so nothing is re-parented away
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def meminfo() -> dict[str, int]:
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, v = line.split(":", 1)
            out[k] = int(v.split()[0]) * 1024
    return out


def pressure() -> dict[str, float]:
    """/proc/pressure/memory as {"some_avg10": .., "some_total_us": .., "full_...": ..}."""
    out = {}
    with open("/proc/pressure/memory") as f:
        for line in f:
            kind, *pairs = line.split()
            for p in pairs:
                k, v = p.split("=")
                out[f"{kind}_{k}" + ("_us" if k == "total" else "")] = float(v)
    return out


@dataclass(frozen=True)
class GuardLimits:
    """Thresholds; None switches one off. system_used is the paper's default guard (98%)."""
    system_used: float | None = 0.98
    tree_rss_bytes: int | None = None
    cgroup_used: float | None = None     # of the cgroup's limit; the kernel's OOM killer is the backstop

    def __post_init__(self) -> None:
        for name in ("system_used", "cgroup_used"):
            v = getattr(self, name)
            if v is not None and not 0.0 < v <= 1.0:
                raise FormatError(f"guard {name} must be a ratio in (0, 1], got {v}")
        if self.tree_rss_bytes is not None and self.tree_rss_bytes <= 0:
            raise FormatError(f"guard tree_rss_bytes must be positive, got {self.tree_rss_bytes}")

    def crossed(self, s: dict) -> str | None:
        if self.system_used is not None and s["system_used_ratio"] > self.system_used:
            return f"system_used_ratio {s['system_used_ratio']:.4f} exceeded {self.system_used:.4f}"
        if self.tree_rss_bytes is not None and s["tree_rss_bytes"] > self.tree_rss_bytes:
            return f"tree_rss_bytes {s['tree_rss_bytes']} exceeded {self.tree_rss_bytes}"
        lim = s.get("cgroup_limit_bytes")
        if self.cgroup_used is not None and lim and s["cgroup_usage_bytes"] > self.cgroup_used * lim:
            return f"cgroup usage {s['cgroup_usage_bytes'] / lim:.4f} of its limit exceeded {self.cgroup_used:.4f}"
        return None


@dataclass
class Guard:
    """with Guard(pid, limits, cgroup_dir) as g: ... ; g.samples, g.tripped, g.summary()."""
    pid: int
    limits: GuardLimits = GuardLimits()
    cgroup: Path | None = None
    interval_s: float = 0.25
    samples: list[dict] = field(default_factory=list)
    tripped: str | None = None

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="mawforge-guard", daemon=True)
        self.t0 = time.time()

    def sample(self) -> dict:
        now = time.time()
        try:
            mi = meminfo()
            s = {"t": now, "tree_rss_bytes": tree_rss_bytes(self.pid),
                 "system_used_ratio": 1.0 - mi["MemAvailable"] / mi["MemTotal"],
                 "mem_available_bytes": mi["MemAvailable"], "mem_total_bytes": mi["MemTotal"]}
            if self.cgroup is not None:
                s["cgroup_usage_bytes"] = int((self.cgroup / "memory.usage_in_bytes").read_text())
                s["cgroup_limit_bytes"] = int((self.cgroup / "memory.limit_in_bytes").read_text())
            try:
                s["pressure"] = pressure()
            except OSError as e:          # kernels without PSI: say so, the sample stays good
                s["pressure"] = {"error": str(e)}
            return s
        except (OSError, ValueError, KeyError) as e:
            return {"t": now, "error": f"{type(e).__name__}: {e}"}

    def _loop(self) -> None:
        while not self._stop.is_set():
            s = self.sample()
            self.samples.append(s)
            if "error" not in s and self.tripped is None:
                reason = self.limits.crossed(s)
                if reason is not None:
                    self.tripped = reason
                    kill_tree(self.pid)
            self._stop.wait(self.interval_s)

    def start(self) -> "Guard":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> "Guard":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def window(self, t0: float, t1: float) -> list[dict]:
        return [s for s in self.samples if t0 <= s["t"] <= t1]

    def summary(self, samples: list[dict] | None = None) -> dict:
        return summarize(self.samples if samples is None else samples, self.tripped, self.limits)


def summarize(samples: list[dict], tripped: str | None = None, limits: GuardLimits | None = None) -> dict:
    good = [s for s in samples if "error" not in s]
    ts = [s["t"] for s in good]
    gap = max((b - a for a, b in zip(ts, ts[1:])), default=None)
    peak = lambda k: max((s[k] for s in good if k in s), default=None)
    return {"samples": len(samples), "failed_samples": len(samples) - len(good), "max_gap_s": gap,
            "max_tree_rss_bytes": peak("tree_rss_bytes"), "max_system_used_ratio": peak("system_used_ratio"),
            "max_cgroup_usage_bytes": peak("cgroup_usage_bytes"),
            "max_pressure_some_avg10": max((s["pressure"].get("some_avg10", 0.0) for s in good
                                            if "pressure" in s), default=None),
            "guard_tripped": tripped is not None, "guard_reason": tripped,
            "guard_limits": None if limits is None else vars(limits)}
