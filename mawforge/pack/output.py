"""Where a pack is written: refusing what would fail half-way or destroy something that is not a
pack, and the atomic finish (every file fsynced, the temp directory renamed into place)."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from mawforge.errors import MawError, PackExists
from mawforge.pack.manifest import MANIFEST


def check_output(out: Path, force: bool) -> None:
    """Refuse what would fail half-way or destroy something that is not a pack."""
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                raise MawError(f"cannot create {out}: {parent} is a file, not a directory")
            if not os.access(parent, os.W_OK):
                raise MawError(f"cannot create {out}: {parent} is not writable")
            break
    if not out.exists() and not out.is_symlink():
        return
    if not out.is_dir():
        raise PackExists(f"{out} exists and is a file, not a pack directory; choose another -o")
    if not force:
        raise PackExists(f"{out} exists; pass --force to replace it")
    if any(out.iterdir()) and not (out / MANIFEST).exists():
        raise PackExists(f"{out} is a non-empty directory that is not a pack; --force only replaces packs")


def fsync_dir(d: Path) -> None:
    for f in d.iterdir():
        with open(f, "rb+") as fh:
            os.fsync(fh.fileno())
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_dir(tmp: Path, out: Path) -> None:
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.rename(out, old)
    os.rename(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
