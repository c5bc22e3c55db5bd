"""Field checks: every value read from manifest.json / experts.index goes through one, so a damaged
or foreign pack is a one-line FormatError naming the field."""
from __future__ import annotations

import re

from mawforge.errors import FormatError

MAX_OFFSET = 1 << 62          # any offset or size at or past this is damage, not a model
_HEX128 = re.compile(r"[0-9a-f]{32}")

def _int(v, what: str, lo: int = 0, hi: int = MAX_OFFSET) -> int:
    if type(v) is not int or not lo <= v < hi:
        raise FormatError(f"{what} must be an integer in [{lo}, {hi}), got {v!r}"[:200])
    return v


def _str(v, what: str) -> str:
    if not isinstance(v, str):
        raise FormatError(f"{what} must be a string, got {type(v).__name__}")
    return v


def _list(v, what: str) -> list:
    if not isinstance(v, list):
        raise FormatError(f"{what} must be a list, got {type(v).__name__}")
    return v


def _obj(v, what: str) -> dict:
    if not isinstance(v, dict):
        raise FormatError(f"{what} must be an object, got {type(v).__name__}")
    return v


def _shape(v, what: str) -> tuple[int, ...]:
    dims = _list(v, what)
    if not 1 <= len(dims) <= 8:
        raise FormatError(f"{what} must have 1 to 8 dims, got {len(dims)}")
    return tuple(_int(s, what, 0, 1 << 40) for s in dims)


def _hex(v, what: str) -> str:
    if not isinstance(v, str) or not _HEX128.fullmatch(v):
        raise FormatError(f"{what} must be a 32-digit hex digest, got {v!r}"[:200])
    return v
