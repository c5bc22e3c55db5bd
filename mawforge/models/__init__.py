"""The model layer: base.py (the decoder loop and its blocks), kv.py, deltanet.py, mtp.py. The
architectures' own classes live in mawforge/archs/<name>/model.py; `model_class` imports one."""
from __future__ import annotations

import functools

from mawforge.archs import get


@functools.lru_cache(maxsize=None)
def model_class(arch: str) -> type:
    return get(arch).model_class()
