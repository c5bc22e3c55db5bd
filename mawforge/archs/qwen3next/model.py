"""Qwen3-Next's model class: Qwen3.5's, whose delta-net (models/deltanet.py) reads the fused
projections."""
from __future__ import annotations

from mawforge.archs.qwen35moe.model import Qwen35Moe


class Qwen3Next(Qwen35Moe):
    pass
