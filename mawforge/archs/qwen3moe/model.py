"""Qwen3-MoE's model class; torch and the model code load here, not when the registry is read.
The per-head q/k RMSNorm is the shared `qk_norm` hook's "head" kind (cfg.qk_norm, set by the
defaults in __init__.py)."""
from __future__ import annotations

from mawforge.models.base import MoETransformer


class Qwen3Moe(MoETransformer):
    pass
