"""MoE-aware accounting for speculative decoding (MawForge §VII-E), free of torch.

A verify step runs [last] + k drafts through the expert cache in one batch, so each MoE layer
touches the *union* of several tokens' experts, including those of drafts that are then
rejected. Three pieces measure what that costs:

- `RouteTap` observes the expert cache and keeps the step's routing per layer;
- `Counterfactual` replays, through a copy of the live cache core and the same policy code,
  only the positions plain decoding would have run (one token per step), so
  live minus counterfactual is the extra materialization speculation caused, per step;
- `AutoController` alternates short windows of speculative and plain decoding, keeps a running
  tokens/s estimate of each, and speculates only while that estimate wins.

Legend: T tokens in a step, k experts per token.
"""
from __future__ import annotations

import copy

import numpy as np

from mawforge.cache.driver import RouteDriver
from mawforge.cache.observer import CacheObserver
from mawforge.engine.online import OnlineChooser

COUNTERS = ("hits", "misses", "evictions", "materialized_bytes", "prefetch_issued_bytes")


def counters(core) -> dict:
    s = core.stats()
    return {k: getattr(s, k) for k in COUNTERS}


def delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in COUNTERS}


class RouteTap(CacheObserver):
    """Keeps the routing of the steps since `clear()` (an observer of the expert cache)."""

    def __init__(self) -> None:
        self.rows: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}

    def clear(self) -> None:
        self.rows = {}

    def record(self, layer: int, idx: np.ndarray, w: np.ndarray) -> None:
        self.rows.setdefault(layer, []).append((idx.copy(), w.copy()))     # [T, k] each

    def routing(self) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """layer -> (experts [T, k], weights [T, k]) over every chunk since clear()."""
        return {l: (np.concatenate([i for i, _ in r]), np.concatenate([w for _, w in r]))
                for l, r in self.rows.items()}

    def union_per_layer(self) -> list[int]:
        return [len(np.unique(idx)) for _, (idx, _) in sorted(self.routing().items())]


class Counterfactual:
    """Plain decoding's cache, run beside the live one: a copy of the live core (and prefetcher)
    taken when decoding starts, fed one token per step with the routing the live verify steps
    saw for the positions that were kept. Exact when routing is position-wise identical (it is:
    same tokens, same KV); live-only router lookahead prefetch is not replayed."""

    def __init__(self, cache) -> None:
        self.core = copy.deepcopy(cache.core)
        self.driver = RouteDriver(self.core, cache.block_bytes, copy.deepcopy(cache.driver.prefetcher),
                                  cache.driver.n_experts)

    def run(self, routing: dict[int, tuple[np.ndarray, np.ndarray]], n_tokens: int) -> dict:
        """Replay the first n_tokens positions as single-token steps; returns the counter delta."""
        before = counters(self.core)
        layers = sorted(routing)
        for t in range(n_tokens):
            self.driver.begin_step("decode", 1)
            for layer in layers:
                idx, w = routing[layer]
                for _ in self.driver.layer(layer, idx[t:t + 1], w[t:t + 1]):
                    pass
                self.driver.after_layer(layer)
            self.driver.end_step()
        return delta(counters(self.core), before)


class AutoController(OnlineChooser):
    """Chooses 'spec' or 'plain' per window of `window` emitted tokens by tokens/s (time measured
    inside the engine only, so materialization stalls count against the mode that caused them):
    both explored first, then the faster run, the slower re-probed one window in `probe_every`."""

    def __init__(self, window: int = 8, probe_every: int = 4, alpha: float = 0.5) -> None:
        super().__init__(("spec", "plain"), window, probe_every, alpha)

    def report(self) -> dict:
        return {"window_tokens": self.window, "spec_tok_s": self.rate["spec"], "plain_tok_s": self.rate["plain"],
                "spec_windows": self.windows["spec"], "plain_windows": self.windows["plain"],
                "speculating": self.current == "spec"}
