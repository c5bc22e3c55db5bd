"""The model layer: base.py (the decoder loop and its blocks), kv.py, deltanet.py, mtp.py. The
architectures themselves live one file each in mawforge/archs/; `model_class` builds theirs."""
from __future__ import annotations

import functools

from mawforge.archs import get


@functools.lru_cache(maxsize=None)
def model_class(arch: str) -> type:
    return get(arch).model()
