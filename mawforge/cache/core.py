"""The torch-free cache core: byte-accounted residency, pins, counters, and the access plan.

Every decision that changes hit or miss counts lives here, in `policies.py` or in the
access plan of `driver.py` (RouteDriver); the live `ExpertCache` only mirrors storage, and
offline replay calls the same driver with the same sequence, so the counts agree.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import numpy as np

from mawforge.cache.policies import Key, Policy
from mawforge.errors import BudgetRejected

BlockBytes = Callable[[int, int], int]  # (layer, expert) -> block bytes
# per-block event counts kept when CacheCore.track_heat() is on (the dashboard's heatmap)
HEAT_FIELDS = ("hits", "misses", "evictions", "prefetch_loads", "prefetch_useful", "prefetch_wasted")


def read_bytes(counters) -> int:
    """Bytes these counters say the cache read from the pack (a stats() or totals() dict, or
    CacheStats.to_dict()): demand loads plus prefetches issued, a prefetch counted when issued,
    used or not."""
    return counters["materialized_bytes"] + counters["prefetch_issued_bytes"]


def min_capacity(block_sizes_per_layer: Sequence[int | Sequence[int]], top_k: int) -> int:
    """Bytes of the largest layer's top-k working set: the k largest blocks of a layer.
    Each item is one layer's block size (uniform) or its per-expert block sizes."""
    best = 0
    for sizes in block_sizes_per_layer:
        if isinstance(sizes, (int, np.integer)):
            need = int(sizes) * top_k
        else:
            need = int(sum(sorted((int(s) for s in sizes), reverse=True)[:top_k]))
        best = max(best, need)
    return best


def check_capacity(capacity_bytes: int, block_sizes_per_layer, top_k: int) -> int:
    """Return the minimum; raise BudgetRejected when the capacity is below it."""
    need = min_capacity(block_sizes_per_layer, top_k)
    if capacity_bytes < need:
        raise BudgetRejected(
            f"expert cache of {capacity_bytes} bytes is below the minimum {need} bytes "
            f"(one layer's top-{top_k} working set)")
    return need


def unique_experts(experts) -> list[int]:
    """The layer's distinct experts in ascending id order (expert-major access order); -1 (a miss a
    lossy decode skipped, models/miss_policy.py) is no access."""
    if isinstance(experts, np.ndarray):
        if experts.ndim == 2 and experts.shape[0] == 1:  # decode: skip np.unique's overhead
            return sorted(e for e in set(experts[0].tolist()) if e >= 0)
        ids = np.unique(experts)
        return ids[ids >= 0].tolist()
    flat = set()
    for row in experts:
        if isinstance(row, (int, np.integer)):
            flat.add(int(row))
        else:
            flat.update(int(e) for e in row)
    return sorted(e for e in flat if e >= 0)


def plan_groups(sizes: Sequence[int], capacity_bytes: int) -> list[tuple[int, int]]:
    """Split an access list into consecutive [start, end) groups whose bytes fit."""
    groups, start, total = [], 0, 0
    for i, size in enumerate(sizes):
        if total + size > capacity_bytes and i > start:
            groups.append((start, i))
            start, total = i, 0
        total += size
    if start < len(sizes):
        groups.append((start, len(sizes)))
    return groups


@dataclass(frozen=True)
class LayerStats:
    layer: int
    hits: int
    misses: int
    evictions: int
    materialized_bytes: int


@dataclass(frozen=True)
class CacheStats:
    """Counters. Hits and misses count block accesses (one per distinct expert per layer
    group), not token-expert pairs. materialized_bytes: logical bytes loaded on demand.
    Prefetch: useful = demanded while still resident; wasted = evicted before use;
    pending = still resident, not yet used (wasted if the run ends now)."""
    capacity_bytes: int
    used_bytes: int
    hits: int
    misses: int
    evictions: int
    materialized_bytes: int
    prefetch_issued: int
    prefetch_issued_bytes: int
    prefetch_useful: int
    prefetch_useful_bytes: int
    prefetch_wasted: int
    prefetch_wasted_bytes: int
    prefetch_pending_bytes: int
    prefetch_probes: int
    prefetch_dropped: int
    per_layer: tuple[LayerStats, ...]
    prefetch_spared: int = 0     # drops because only blocks about to be used could make room

    @property
    def accesses(self) -> int:
        return self.hits + self.misses

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0

    @property
    def prefetch_hits(self) -> int:
        """Demand hits on blocks that were resident only because prefetch loaded them."""
        return self.prefetch_useful

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(accesses=self.accesses, hit_rate=self.hit_rate)
        return out


class CacheCore:
    """Which blocks are resident, their bytes, pins and counters. Never holds tensors."""

    def __init__(self, capacity_bytes: int, policy: Policy) -> None:
        if capacity_bytes <= 0:
            raise BudgetRejected(f"expert cache capacity must be positive, got {capacity_bytes} bytes")
        self.capacity_bytes = int(capacity_bytes)
        self.policy = policy
        policy.bind(self.capacity_bytes)
        self.used_bytes = 0
        self.pinned_bytes = 0
        self._size: dict[Key, int] = {}
        self._pins: dict[Key, int] = {}
        self._unused_prefetch: set[Key] = set()
        self._layers: dict[int, list[int]] = {}  # layer -> [hits, misses, evictions, bytes]
        self._pf = dict(issued=0, issued_bytes=0, useful=0, useful_bytes=0, wasted=0,
                        wasted_bytes=0, probes=0, dropped=0, spared=0)
        self.heat: np.ndarray | None = None          # [len(HEAT_FIELDS), layers * experts] counts
        self.resident_map: np.ndarray | None = None  # [layers * experts] bool

    def track_heat(self, n_layers: int, n_experts: int) -> None:
        """Count events per block as well (off by default: replay does not need them). Arrays,
        not dicts, so a reader copies and diffs them in microseconds whatever the model's size;
        a count costs the engine about 0.3 us."""
        if self.heat is None:
            self._experts = n_experts
            self.heat = np.zeros((len(HEAT_FIELDS), n_layers * n_experts), np.int64)
            self.resident_map = np.zeros(n_layers * n_experts, np.bool_)
            for key in self._size:
                self.resident_map[key[0] * n_experts + key[1]] = True

    # -- residency -----------------------------------------------------------------
    def __contains__(self, key: Key) -> bool:
        """A probe: never touches the policy, so recency is preserved."""
        return key in self._size

    def __len__(self) -> int:
        return len(self._size)

    def resident(self) -> list[Key]:
        return list(self._size)

    def is_evictable(self, key: Key) -> bool:
        return key not in self._pins

    def pin(self, key: Key) -> None:
        n = self._pins.get(key, 0)
        if n == 0:
            self.pinned_bytes += self._size[key]
        self._pins[key] = n + 1

    def unpin(self, key: Key) -> None:
        n = self._pins[key]
        if n == 1:
            del self._pins[key]
            self.pinned_bytes -= self._size[key]
        else:
            self._pins[key] = n - 1

    def _counters(self, layer: int) -> list[int]:
        c = self._layers.get(layer)
        if c is None:
            c = self._layers[layer] = [0, 0, 0, 0]
        return c

    def _evict_for(self, nbytes: int, keep: Callable[[Key], bool] | None = None) -> tuple[list[Key], bool]:
        """Evict until nbytes fit; returns (evicted keys, whether they fit now). keep(key) True
        marks a block this eviction must spare (a prefetch spares the blocks about to be used);
        when only such blocks are left it stops short (what it evicted before stays evicted)."""
        evicted = []
        ok = self.is_evictable if keep is None else (lambda k: k not in self._pins and not keep(k))
        while self.used_bytes + nbytes > self.capacity_bytes:
            key = self.policy.victim(ok)
            if key is None and keep is not None:
                return evicted, False
            if key is None or key in self._pins or key not in self._size:
                raise RuntimeError(f"policy {self.policy.spec} returned bad victim {key}")
            size = self._size.pop(key)
            self.used_bytes -= size
            if self.heat is not None:
                self.resident_map[key[0] * self._experts + key[1]] = False
            self.policy.on_remove(key)
            self._counters(key[0])[2] += 1
            if self.heat is not None:
                self.heat[2, key[0] * self._experts + key[1]] += 1
            if key in self._unused_prefetch:
                self._unused_prefetch.discard(key)
                self._pf["wasted"] += 1
                self._pf["wasted_bytes"] += size
                if self.heat is not None:
                    self.heat[5, key[0] * self._experts + key[1]] += 1
            evicted.append(key)
        return evicted, True

    def _insert(self, key: Key, nbytes: int, reuse: float = 0.0) -> None:
        self._size[key] = nbytes
        if self.heat is not None:
            self.resident_map[key[0] * self._experts + key[1]] = True
        self.used_bytes += nbytes
        assert self.used_bytes <= self.capacity_bytes, "expert cache over capacity"
        self.policy.on_insert(key, nbytes, reuse)

    def _fits_after_eviction(self, nbytes: int) -> bool:
        return self.pinned_bytes + nbytes <= self.capacity_bytes

    # -- the two ways a block becomes resident --------------------------------------
    def access(self, key: Key, nbytes: int, reuse: float = 0.0) -> tuple[bool, list[Key]]:
        """A demand access. Returns (hit, evicted keys in eviction order). reuse: the step's
        evidence of reuse for the block, passed to the policy (see policies.py)."""
        counters = self._counters(key[0])
        if key in self._size:
            counters[0] += 1
            if key in self._unused_prefetch:
                self.policy.on_first_use(key, reuse)
                self._unused_prefetch.discard(key)
                self._pf["useful"] += 1
                self._pf["useful_bytes"] += self._size[key]
                if self.heat is not None:
                    self.heat[4, key[0] * self._experts + key[1]] += 1
            else:
                self.policy.on_hit(key, reuse)
            if self.heat is not None:
                self.heat[0, key[0] * self._experts + key[1]] += 1
            return True, []
        if not self._fits_after_eviction(nbytes):
            raise BudgetRejected(
                f"expert cache of {self.capacity_bytes} bytes cannot load block {key} "
                f"({nbytes} bytes) with {self.pinned_bytes} bytes pinned")
        # a miss spares the prefetched, not yet used blocks of its own layer and the later ones
        # while the policy offers any other victim: they are about to be used (router lookahead
        # asked for them up to two layers ahead), and a policy that evicts new blocks first
        # (S3-FIFO's small queue) would drop them for this step's own misses and read them again:
        # a 64-token prefill inside 6 GiB read 16.9 GB for the 11.4 GB its experts need, 11.6 so
        # (full-size file, Intel Xeon, benchmarks/RESULTS.md runs 8 and 9)
        layer = key[0]
        pending = self._unused_prefetch
        evicted, fits = self._evict_for(nbytes, (lambda k: k[0] >= layer and k in pending) if pending else None)
        if not fits:
            more, _ = self._evict_for(nbytes)
            evicted += more
        counters[1] += 1
        counters[3] += nbytes
        self._insert(key, nbytes, reuse)
        if self.heat is not None:
            self.heat[1, key[0] * self._experts + key[1]] += 1
        return False, evicted

    def prefetch(self, key: Key, nbytes: int, touch: bool = False,
                 keep: Callable[[Key], bool] | None = None) -> tuple[str, list[Key]]:
        """A speculative load through the same byte budget. Returns (status, evicted):
        'probe' (already resident; with touch=True the policy sees a hit, refreshing
        recency), 'load' (now resident, counted as issued), 'drop' (pins leave no room, or
        only blocks that `keep` spares could make room; the evicted list may then be non-empty)."""
        if self.probe(key, touch):
            return "probe", []
        if not self._fits_after_eviction(nbytes):
            self._pf["dropped"] += 1
            return "drop", []
        evicted, fits = self._evict_for(nbytes, keep)
        if not fits:                      # only blocks `keep` spares were left
            self._pf["dropped"] += 1
            self._pf["spared"] += 1
            return "drop", evicted
        self._insert(key, nbytes)
        self._unused_prefetch.add(key)
        self._pf["issued"] += 1
        self._pf["issued_bytes"] += nbytes
        if self.heat is not None:
            self.heat[3, key[0] * self._experts + key[1]] += 1
        return "load", evicted

    def probe(self, key: Key, touch: bool = False) -> bool:
        """A prefetch of a resident block: counted as a probe (with touch, the policy sees a hit).
        False, doing nothing, where the block is not resident."""
        if key not in self._size:
            return False
        self._pf["probes"] += 1
        if touch:
            self.policy.on_hit(key)
        return True

    # -- counters ------------------------------------------------------------------
    def snapshot(self) -> dict:
        """The state as plain copies, for a reader on ANOTHER thread (the dashboard) while the
        engine thread keeps changing it: each container is copied by one C-level call, which
        the GIL makes atomic, so nothing here iterates a dict that can change size under it
        (the heat arrays are copied whole; a count landing mid-copy is read old or new).
        Costs microseconds for thousands of blocks; the engine never waits for it."""
        heat = self.heat is not None
        return {"resident": list(self._size), "pinned": list(self._pins),
                "prefetch_pending": list(self._unused_prefetch), "used_bytes": self.used_bytes,
                "layers": [(layer, tuple(c)) for layer, c in list(self._layers.items())],
                "prefetch": dict(self._pf), "heat": self.heat.copy() if heat else None,
                "resident_map": self.resident_map.copy() if heat else None}

    def totals(self) -> dict:
        """The running counters a request's telemetry takes deltas of, without building the
        per-layer stats (a batch attributes each layer's reads with it: stats() is ~0.5 ms)."""
        h = m = ev = mb = 0
        for c in self._layers.values():
            h, m, ev, mb = h + c[0], m + c[1], ev + c[2], mb + c[3]
        pf = self._pf
        return {"hits": h, "misses": m, "evictions": ev, "materialized_bytes": mb,
                "prefetch_issued_bytes": pf["issued_bytes"], "prefetch_useful_bytes": pf["useful_bytes"],
                "prefetch_wasted_bytes": pf["wasted_bytes"]}

    def stats(self) -> CacheStats:
        per_layer = tuple(LayerStats(layer, *c) for layer, c in sorted(self._layers.items()))
        pf = self._pf
        return CacheStats(
            capacity_bytes=self.capacity_bytes, used_bytes=self.used_bytes,
            hits=sum(s.hits for s in per_layer), misses=sum(s.misses for s in per_layer),
            evictions=sum(s.evictions for s in per_layer),
            materialized_bytes=sum(s.materialized_bytes for s in per_layer),
            prefetch_issued=pf["issued"], prefetch_issued_bytes=pf["issued_bytes"],
            prefetch_useful=pf["useful"], prefetch_useful_bytes=pf["useful_bytes"],
            prefetch_wasted=pf["wasted"], prefetch_wasted_bytes=pf["wasted_bytes"],
            prefetch_pending_bytes=sum(self._size[k] for k in self._unused_prefetch),
            prefetch_probes=pf["probes"], prefetch_dropped=pf["dropped"], per_layer=per_layer,
            prefetch_spared=pf["spared"])
