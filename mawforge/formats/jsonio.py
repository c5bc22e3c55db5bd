"""Bounded JSON reading for every JSON a user or a client hands us (config.json, the
safetensors index and headers, the pack's manifest and index, HTTP bodies).

json.loads recurses once per nesting level; a body of 100,000 '[' characters raises
RecursionError (or worse, exhausts the C stack in deeper call chains). Here the nesting is
bounded, the size is bounded, bytes must be UTF-8, and any failure is one FormatError line.
"""
from __future__ import annotations

import json
from pathlib import Path

from mawforge.errors import FormatError

MAX_DEPTH = 64                 # real configs nest 4-5 levels; chat requests 5-8
MAX_FILE_BYTES = 256 << 20     # a JSON sidecar larger than this is not a config or an index


def depth(obj, limit: int = MAX_DEPTH) -> int:
    """Nesting depth of parsed JSON, without recursion; stops counting past `limit`."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, (dict, list)):
            deepest = max(deepest, d)
            if deepest > limit:
                return deepest
            stack.extend((v, d + 1) for v in (o.values() if isinstance(o, dict) else o))
    return deepest


def loads(data: bytes | str, what: str, max_depth: int = MAX_DEPTH):
    """Parse JSON text or UTF-8 bytes; FormatError naming `what` on anything malformed."""
    try:
        if isinstance(data, (bytes, bytearray, memoryview)):
            data = bytes(data).decode("utf-8")
        obj = json.loads(data)
    except UnicodeDecodeError:
        raise FormatError(f"{what}: not UTF-8 text") from None
    except RecursionError:
        raise FormatError(f"{what}: JSON nested deeper than {max_depth} levels") from None
    except ValueError as e:
        raise FormatError(f"{what}: malformed JSON ({e})") from None
    if depth(obj, max_depth) > max_depth:
        raise FormatError(f"{what}: JSON nested deeper than {max_depth} levels")
    return obj


def load_file(path: Path, what: str | None = None, expect=dict, max_bytes: int = MAX_FILE_BYTES):
    """Read and parse a JSON file, bounded in size, and check the top-level type."""
    what = what or str(path)
    try:
        if not path.is_file():
            raise FormatError(f"{what}: {'is a directory' if path.is_dir() else 'no such file'}")
        size = path.stat().st_size
        if size > max_bytes:
            raise FormatError(f"{what}: {size} bytes, more than the {max_bytes} a JSON file may have here")
        raw = path.read_bytes()
    except OSError as e:
        raise FormatError(f"{what}: cannot read ({e.strerror or e})") from None
    obj = loads(raw, what)
    if expect is not None and not isinstance(obj, expect):
        raise FormatError(f"{what}: expected a JSON {'object' if expect is dict else expect.__name__}, "
                          f"got {type(obj).__name__}")
    return obj
