"""The expert cache's observers: torch-free, so the route-trace format (trace/record.py) can
be one without importing the cache's tensors."""
from __future__ import annotations

import numpy as np


class CacheObserver:
    """Told what the expert cache does, in order; observes, never changes it. Subclasses
    override what they need (trace/record.py TraceRecorder, the dashboard's RequestTraces,
    speculation's RouteTap). Add one with `ExpertCache.observers.append`, remove it when done."""

    def begin_step(self, kind: str, n_tokens: int, prefetch: bool = True) -> None:
        """A forward step of n_tokens starts ("prefill" or "decode"; prefetch on or off)."""

    def record(self, layer: int, idx: np.ndarray, w: np.ndarray) -> None:
        """A layer's routing: experts and weights [T, k]."""

    def lookahead(self, keys: list) -> None:
        """Router lookahead asked for these (layer, expert) blocks."""
