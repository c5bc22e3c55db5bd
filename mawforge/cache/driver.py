"""The access plan: RouteDriver turns routing decisions into cache accesses, identically live and
in replay (torch-free, over CacheCore). The live `ExpertCache` only mirrors storage (free
`evicted`, then load `misses`/`loads`).

Call sequence per step (live and replay):
    plan = driver.begin_step(kind, n_tokens)        # prefetch for the first MoE layer
    for each MoE layer l:
        for group in driver.layer(l, experts, weights):   # experts/weights: [T, k]
            free group.evicted; load group.misses; compute with group.keys
        plan = driver.after_layer(l)                # prefetch for the next MoE layer
    plan = driver.end_step()

Legend: T tokens in the step, k experts per token (top-k).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np

from mawforge.cache.core import BlockBytes, CacheCore, plan_groups, unique_experts
from mawforge.cache.policies import Key


@dataclass(frozen=True, slots=True)
class Group:
    """Blocks computed together. The runtime frees `evicted` first, then loads `misses`;
    all of `keys` stay pinned until the consumer asks for the next group."""
    layer: int
    keys: tuple[Key, ...]
    misses: tuple[Key, ...]
    evicted: tuple[Key, ...]


@dataclass(frozen=True, slots=True)
class PrefetchPlan:
    """Speculative loads: free `evicted` first, then load `loads`; `probed` were resident."""
    loads: tuple[Key, ...] = ()
    evicted: tuple[Key, ...] = ()
    probed: tuple[Key, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.loads or self.evicted or self.probed)


EMPTY_PLAN = PrefetchPlan()


class RouteDriver:
    """Turns routing decisions into cache accesses, identically live and in replay."""

    def __init__(self, core: CacheCore, block_bytes: BlockBytes, prefetcher=None,
                 n_experts: int | None = None) -> None:
        self.core = core
        self.block_bytes = block_bytes
        self.prefetcher = prefetcher
        self.n_experts = n_experts  # for each access's reuse evidence (none computed without it)
        self.enabled = True     # False: this step issues no prefetch (`--prefetch auto` measuring "off")
        self.kind = "decode"
        self.n_tokens = 0
        self.next_layer = 0     # the layer whose experts this step computes next (lookahead spares from it)

    def begin_step(self, kind: str, n_tokens: int) -> PrefetchPlan:
        """Start a step; returns the prefetch for the first MoE layer (live: start it)."""
        if kind not in ("prefill", "decode"):
            raise ValueError(f"step kind must be 'prefill' or 'decode', got {kind!r}")
        self.kind, self.n_tokens, self.next_layer = kind, n_tokens, 0
        if self.prefetcher is None or not self.enabled:
            return EMPTY_PLAN
        return self._prefetch_before(None)

    def layer(self, layer: int, experts, weights=None) -> Iterator[Group]:
        """experts, weights: [T, k] (numpy or nested lists). Yields groups; exhaust it."""
        self.next_layer = layer + 1
        if self.prefetcher is not None:
            self.prefetcher.observe(layer, experts, weights)
        core, size_of = self.core, self.block_bytes
        ids, reuse = self._reuse(experts)
        keys = [(layer, e) for e in ids]
        sizes = [size_of(layer, e) for e in ids]
        pinned: list[Key] = []
        try:
            for start, end in plan_groups(sizes, core.capacity_bytes):
                misses, evicted = [], []
                for i in range(start, end):
                    key = keys[i]
                    hit, gone = core.access(key, sizes[i], reuse[i] if reuse else 0.0)
                    core.pin(key)
                    pinned.append(key)
                    if not hit:
                        misses.append(key)
                        evicted.extend(gone)
                yield Group(layer, tuple(keys[start:end]), tuple(misses), tuple(evicted))
                for key in pinned:
                    core.unpin(key)
                pinned.clear()
        finally:
            for key in pinned:
                core.unpin(key)

    def _reuse(self, experts) -> tuple[list[int], list[float] | None]:
        """The layer's distinct experts (ascending) and, for a step of several tokens, each
        one's evidence of reuse inside the step: the tokens routed to it over its uniform share
        (T * k / n_experts), 0 where only one token was. A block most of a prompt's tokens use
        is likely used by the tokens after it; one used once is not (policies.py S3FIFO)."""
        if self.n_experts is None or len(experts) <= 1:
            return unique_experts(experts), None
        arr = np.asarray(experts)
        if arr.ndim != 2 or arr.dtype == object:
            return unique_experts(experts), None
        ids, counts = np.unique(arr, return_counts=True)
        ids, counts = ids[ids >= 0], counts[ids >= 0]       # -1: a skipped miss, no access
        share = arr.size / self.n_experts
        return ids.tolist(), [c / share if c > 1 else 0.0 for c in counts.tolist()]

    def after_layer(self, layer: int) -> PrefetchPlan:
        """Returns the prefetch for the next MoE layer, issued while this one finishes."""
        if self.prefetcher is None or not self.enabled:
            return EMPTY_PLAN
        return self._prefetch_before(layer)

    def end_step(self) -> PrefetchPlan:
        """Hook for step-level prefetchers; the built-in ones act per layer."""
        return EMPTY_PLAN

    def lookahead(self, keys: Iterable[Key]) -> PrefetchPlan:
        """A router-lookahead prefetch for a later layer l (one or more ahead), issued before the
        experts of the layer this step computes next: it spares the blocks of every layer from
        that one to l (all about to be used). The same keys at the same point give the same
        plan live and in replay: the spared range follows from the layers driven so far."""
        return self.prefetch(keys, spare_from=self.next_layer)

    def prefetch(self, keys: Iterable[Key], touch: bool = False, spare_before: int = 0,
                 spare_from: int | None = None) -> PrefetchPlan:
        """Issue speculative loads through the byte budget. Keys of one plan are pinned while
        it is built, so a plan never evicts its own loads, and a prefetch for layer l never
        evicts a block of layer l (nor of the `spare_before` layers before it, or of the layers
        from `spare_from` on, where given): those are about to be used, so making room with them
        would turn a likely hit into a miss. Such a prefetch is dropped instead."""
        loads, evicted, probed, pinned = [], [], [], []
        core = self.core
        try:
            for key in keys:
                if core.probe(key, touch):        # resident: the common case, kept cheap
                    probed.append(key)
                    core.pin(key)
                    pinned.append(key)
                    continue
                hi = key[0]
                lo = hi - spare_before if spare_from is None else min(spare_from, hi)
                status, gone = core.prefetch(key, self.block_bytes(*key), touch,
                                             keep=lambda k, lo=lo, hi=hi: lo <= k[0] <= hi)
                evicted.extend(gone)
                if status == "drop":
                    continue
                loads.append(key)                 # not resident a moment ago: a load
                core.pin(key)
                pinned.append(key)
        finally:
            for key in pinned:
                core.unpin(key)
        return PrefetchPlan(tuple(loads), tuple(evicted), tuple(probed))

    def _prefetch_before(self, after: int | None) -> PrefetchPlan:
        keys = self.prefetcher.predict(self.kind, after)
        return self.prefetch(keys, touch=self.prefetcher.touch) if keys else EMPTY_PLAN
