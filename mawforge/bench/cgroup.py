"""cgroup v1 memory limits that make this machine look smaller for one cell, page cache included.

    with MemoryCgroup(limit_bytes) as cg:
        Popen(cg.wrap(cmd))          # the child joins the group before it execs, so every page
                                     # it (and its children) touch is charged to the group
Groups are named mawforge-bench-<owner pid>-<n> under the group this process is in (so an
outer limit still applies); `clean_stale()` removes those whose owner is gone (after a crash).
"""
from __future__ import annotations

import itertools
import os
import shlex
import time
from pathlib import Path

from mawforge.errors import MawError

ROOT = Path("/sys/fs/cgroup/memory")
PREFIX = "mawforge-bench-"
_seq = itertools.count()


def own_group(root: Path = ROOT) -> Path:
    """The memory cgroup this process belongs to (from /proc/self/cgroup)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return root / path.lstrip("/")
    return root


def available(root: Path = ROOT) -> bool:
    g = own_group(root)
    return (g / "memory.limit_in_bytes").exists() and os.access(g, os.W_OK)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(group: Path, parent: Path) -> None:
    """Move any straggler task to the parent (so rmdir can succeed), then remove the group."""
    for _ in range(50):
        try:
            pids = (group / "cgroup.procs").read_text().split()
        except FileNotFoundError:
            return
        for pid in pids:
            try:
                (parent / "cgroup.procs").write_text(pid)
            except OSError:
                pass
        try:
            group.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.1)               # tasks still leaving the group
    raise MawError(f"could not remove cgroup {group}")


def clean_stale(parent: Path | None = None) -> list[str]:
    """Remove mawforge-bench-* groups whose owning process is gone; returns their names."""
    parent = parent or own_group()
    removed = []
    for g in sorted(parent.glob(PREFIX + "*")):
        owner = g.name[len(PREFIX):].split("-")[0]
        if owner.isdigit() and not _pid_alive(int(owner)):
            _remove(g, parent)
            removed.append(g.name)
    return removed


class MemoryCgroup:
    """A child memory cgroup with memory.limit_in_bytes = limit_bytes (swap not limited here:
    this machine has none; memsw is set to the same value where the kernel offers it)."""

    def __init__(self, limit_bytes: int, parent: Path | None = None):
        if limit_bytes <= 0:
            raise MawError(f"the cgroup memory limit must be positive, got {limit_bytes}")
        self.parent = parent or own_group()
        self.limit_bytes = limit_bytes
        self.path = self.parent / f"{PREFIX}{os.getpid()}-{next(_seq)}"

    def __enter__(self) -> "MemoryCgroup":
        try:
            self.path.mkdir()
            (self.path / "memory.limit_in_bytes").write_text(str(self.limit_bytes))
            memsw = self.path / "memory.memsw.limit_in_bytes"
            if memsw.exists():
                try:
                    memsw.write_text(str(self.limit_bytes))
                except OSError:
                    pass                  # memsw accounting disabled: the plain limit still holds
        except OSError as e:
            self.close()
            raise MawError(f"cannot create a memory cgroup under {self.parent}: {e.strerror or e} "
                           "(needs cgroup v1 and root)") from None
        return self

    def wrap(self, cmd: list[str]) -> list[str]:
        """cmd run by a shell that first writes its own pid into the group, then execs cmd."""
        procs = shlex.quote(str(self.path / "cgroup.procs"))
        return ["/bin/sh", "-c", f'echo $$ > {procs} && exec "$@"', "mawforge-cgroup", *cmd]

    def stats(self) -> dict:
        read = lambda n: int((self.path / n).read_text()) if (self.path / n).exists() else None
        oom = {}
        if (self.path / "memory.oom_control").exists():
            oom = dict(line.split() for line in (self.path / "memory.oom_control").read_text().splitlines())
        return {"path": str(self.path), "limit_bytes": read("memory.limit_in_bytes"),
                "max_usage_bytes": read("memory.max_usage_in_bytes"), "failcnt": read("memory.failcnt"),
                "oom_kill": int(oom["oom_kill"]) if "oom_kill" in oom else None}

    def close(self) -> None:
        if self.path.exists():
            _remove(self.path, self.parent)

    def __exit__(self, *exc) -> None:
        self.close()
