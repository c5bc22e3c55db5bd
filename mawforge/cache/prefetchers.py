"""Prefetch policies: pure Python, shared by the live expert cache and offline replay, like the
eviction policies in policies.py. A prefetcher predicts the next MoE layer's experts from the
routing seen so far; the driver sends its predictions through `CacheCore.prefetch`."""

from __future__ import annotations

import bisect
from typing import ClassVar

from mawforge.cache.policies import Key
from mawforge.errors import RequestError


class Prefetcher:
    """Base class and registry of prefetch policies ('confidence:0.2', ...).

    The driver calls `observe(layer, experts, weights)` when a layer's routing is known and
    `predict(kind, after_layer)` before the next MoE layer runs (after_layer None: the
    step's first MoE layer); predicted keys go through `CacheCore.prefetch`. `touch` says
    whether a resident prediction counts as a use for the policy (refreshing recency)."""

    name: ClassVar[str] = ""
    touch: ClassVar[bool] = True
    prefill_only: ClassVar[bool] = False
    _registry: ClassVar[dict[str, type["Prefetcher"]]] = {}

    def __init_subclass__(cls, name: str = "", **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if name:
            cls.name = name
            Prefetcher._registry[name] = cls

    def observe(self, layer: int, experts, weights) -> None:
        raise NotImplementedError

    def predict(self, kind: str, after_layer: int | None) -> list[Key]:
        raise NotImplementedError


def make_prefetcher(spec: str | None) -> Prefetcher | None:
    """'none', 'confidence[:T]', 'confidence-prefill[:T]', 'preserve[:T]', 'preserve-prefill[:T]'."""
    if spec is None or spec.strip().lower() in ("", "none"):
        return None
    name, _, arg = spec.strip().partition(":")
    cls = Prefetcher._registry.get(name.lower())
    if cls is None:
        names = ", ".join(["none", *sorted(Prefetcher._registry)])
        raise RequestError(f"unknown prefetch policy {spec!r}; choose from {names}")
    try:
        threshold = float(arg) if arg else ConfidencePrefetcher.DEFAULT_THRESHOLD
    except ValueError:
        raise RequestError(f"prefetch threshold must be a number, got {arg!r}") from None
    return cls(threshold)


class ConfidencePrefetcher(Prefetcher, name="confidence"):
    """Confidence-gated (Routide §3.3): before layer l of a step, prefetch the experts that
    the previous step's last token sent to layer l with normalized weight >= threshold,
    highest weight first. Resident predictions touch the policy (as a cache check would)."""

    DEFAULT_THRESHOLD = 0.20

    def __init__(self, threshold: float = DEFAULT_THRESHOLD) -> None:
        if not 0.0 < threshold <= 1.0:
            raise RequestError(f"prefetch threshold must be in (0, 1], got {threshold}")
        self.threshold = threshold
        self._last: dict[int, list[int]] = {}  # layer -> confident experts, best first
        self._layers: list[int] = []  # MoE layers seen, ascending

    @property
    def spec(self) -> str:
        return f"{self.name}:{self.threshold:g}"

    def observe(self, layer: int, experts, weights) -> None:
        if weights is None:
            return
        row_e = [int(e) for e in experts[-1]]  # the step's last token
        row_w = [float(w) for w in weights[-1]]
        total = sum(row_w)
        if total <= 0:
            return
        if layer not in self._last:
            bisect.insort(self._layers, layer)
        ranked = sorted(range(len(row_e)), key=lambda i: (-row_w[i], i))
        self._last[layer] = [row_e[i] for i in ranked if row_w[i] / total >= self.threshold and row_e[i] >= 0]

    def predict(self, kind: str, after_layer: int | None) -> list[Key]:
        if self.prefill_only and kind != "prefill":
            return []
        i = 0 if after_layer is None else bisect.bisect_right(self._layers, after_layer)
        if i >= len(self._layers):
            return []
        layer = self._layers[i]
        return [(layer, e) for e in self._last.get(layer, ())]


class ConfidencePrefillPrefetcher(ConfidencePrefetcher, name="confidence-prefill"):
    """Confidence-gated, during prefill steps only (the Routide setting)."""
    prefill_only = True


class PreservePrefetcher(ConfidencePrefetcher, name="preserve"):
    """Confidence-gated, but a resident prediction is only probed: recency is preserved."""
    touch = False


class PreservePrefillPrefetcher(PreservePrefetcher, name="preserve-prefill"):
    """Preserve-resident, during prefill steps only."""
    prefill_only = True
