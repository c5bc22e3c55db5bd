"""An in-place pack's records (docs/pack-format.md): the source files its expert blocks are read
from, where each expert tensor lies in them, and where a source file is now."""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

from mawforge.errors import IntegrityError
from mawforge.pack.fields import _hex, _int, _list, _obj, _str

PAGE = 4096


@dataclass(frozen=True)
class SourceFile:
    """A source GGUF file an in-place pack reads its expert blocks from."""
    name: str        # the file's name
    path: str        # its absolute path when packed
    relpath: str     # its path relative to the pack directory when packed (tried first)
    size: int

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict, what: str) -> "SourceFile":
        d = _obj(d, what)
        return cls(_str(d.get("name"), f"{what} name"), _str(d.get("path"), f"{what} path"),
                   _str(d.get("relpath"), f"{what} relpath"), _int(d.get("size"), f"{what} size"))


@dataclass(frozen=True)
class SourceRange:
    """Where one expert tensor of an in-place pack's layer lies: per expert, a byte offset in a
    source file (the length is the tensor's part), and the digest of all its experts' bytes, in
    order, so `verify` can name the tensor that changed."""
    file: int
    tensor: str
    offsets: tuple[int, ...]
    digest: str

    def to_dict(self) -> dict:
        return {"file": self.file, "tensor": self.tensor, "offsets": list(self.offsets), "digest": self.digest}

    @classmethod
    def from_dict(cls, d: dict, what: str, n_files: int) -> "SourceRange":
        d = _obj(d, what)
        return cls(_int(d.get("file"), f"{what} file", 0, max(n_files, 1)), _str(d.get("tensor"), f"{what} tensor"),
                   tuple(_int(o, f"{what} offset") for o in _list(d.get("offsets"), f"{what} offsets")),
                   _hex(d.get("digest"), f"{what} digest"))


def resolve_source(pack: Path, f) -> Path:
    """Where an in-place pack's source file is now: beside the pack as it was when packed (so a
    pack and its model moved together keep working), else where it was. A missing file or one of
    another size is a one-line error naming it (edited, truncated, moved or deleted)."""
    for p in (Path(os.path.normpath(Path(pack) / f.relpath)), Path(f.path)):
        if p.is_file():
            size = p.stat().st_size
            if size != f.size:
                raise IntegrityError(f"{p} has {size} bytes, {f.size} when {Path(pack).name} was packed in place "
                                     "from it: the source changed; run `mawforge verify` or pack it again")
            return p
    raise IntegrityError(f"{f.name}, the source file of in-place pack {Path(pack).name}, is missing "
                         f"(not at {f.path}): moved or deleted; put it back or pack again")
