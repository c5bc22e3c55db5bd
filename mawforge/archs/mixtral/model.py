"""mixtral's model class (torch): see mawforge/archs/mixtral/__init__.py for the facts."""
from __future__ import annotations

from mawforge.models.base import MoETransformer


class Mixtral(MoETransformer):
    pass
