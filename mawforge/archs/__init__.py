"""The architecture registry, filled from the packages in this package: every architecture
package mawforge/archs/<name>/ declares `ARCH = Arch(...)` in its `__init__.py` (see spec.py)
and its model class in `model.py`. Adding an architecture is adding one package; nothing else
lists them. Torch-free: importing this reads the declarations, not the models.
"""
from __future__ import annotations

import importlib
import pkgutil

from mawforge.archs.spec import Arch, ArchArgs
from mawforge.errors import UnsupportedError

_ALL: list[Arch] = []
for _m in pkgutil.iter_modules(__path__):
    if _m.ispkg:
        _ALL.append(importlib.import_module(f"{__name__}.{_m.name}").ARCH)

ARCHS: dict[str, Arch] = {a.name: a for a in sorted(_ALL, key=lambda a: (a.order, a.name))}
GGUF_ALIASES: dict[str, str] = {alias: a.name for a in ARCHS.values() for alias in a.gguf_aliases}
HF_MODEL_TYPES: dict[str, str] = {mt: a.name for a in ARCHS.values() for mt in a.hf_model_types}


def get(name: str) -> Arch:
    try:
        return ARCHS[name]
    except KeyError:
        raise UnsupportedError(f"unsupported architecture {name!r}; supported: {', '.join(ARCHS)}") from None


__all__ = ["ARCHS", "Arch", "ArchArgs", "GGUF_ALIASES", "HF_MODEL_TYPES", "get"]
