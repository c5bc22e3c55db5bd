"""olmoe's model class (torch): see mawforge/archs/olmoe/__init__.py for the facts."""
from __future__ import annotations

from mawforge.models.base import MoETransformer


# the whole-projection q/k RMSNorm is the shared `qk_norm` hook's "full" kind (cfg.qk_norm)
class Olmoe(MoETransformer):
    pass
