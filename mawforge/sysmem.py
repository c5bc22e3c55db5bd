"""How much memory this process can have, read from Linux: the tightest cgroup memory limit above
it (v1 or v2) and the machine's MemAvailable. The planner's default budget (plan.default_budget)."""
from __future__ import annotations

from pathlib import Path

DEFAULT_MARGIN = 0.08                  # of the memory found, left to the page cache, the kernel and others
DEFAULT_MARGIN_MIN = 256 * 2**20
_UNLIMITED = 1 << 60


def cgroup_limit(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> tuple[int, str] | None:
    """The tightest memory limit of this process's cgroup and its parents (v1's memory controller,
    or v2's unified hierarchy), with the group's path; None where no limit is set."""
    best = None
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if "memory" in controllers.split(","):
            base, name = Path(root) / "memory", "memory.limit_in_bytes"
        elif controllers == "":
            base, name = Path(root), "memory.max"
        else:
            continue
        group = Path(path.lstrip("/"))
        for g in [group, *group.parents]:
            try:
                raw = (base / g / name).read_text().strip()
            except OSError:
                continue
            if raw == "max":
                continue
            try:
                v = int(raw)
            except ValueError:
                continue
            if v < _UNLIMITED and (best is None or v < best[0]):
                best = (v, "/" + str(g).lstrip("."))
    return best


def mem_available(meminfo: str = "/proc/meminfo") -> int | None:
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
