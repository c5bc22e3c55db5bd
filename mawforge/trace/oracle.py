"""Farthest-next-use (Belady) references over a trace's demand-access sequence.

The sequence is exactly the one `RouteDriver` produces: per layer record, the distinct
experts in ascending id order, split into groups that fit the capacity (`plan_groups`).

Two references:
- relaxed ("belady"): no pins; on a miss evict the resident block whose next use is
  farthest in the future until the new block fits. With equal block sizes this is
  Belady's MIN, the optimal demand-paging schedule, so its misses are a LOWER BOUND for
  every online policy here (pinned ones included: pins only remove choices). With mixed
  block sizes, optimal paging is NP-hard and farthest-next-use is a heuristic: the result
  is a reference, not a bound, and the report says so.
- pin-constrained ("belady-pinned"): the same rule, but blocks already accessed in the
  current layer group cannot be evicted, as in the live cache. It is a feasible schedule
  (an upper bound on what a clairvoyant pinned cache needs), not a proven optimum.

Prefetching policies can trade demand misses for prefetch loads; compare their total
loads, not demand misses, with these oracles. Ties (e.g. blocks never used again) are
broken by the smaller (layer, expert) key, so results are deterministic.

Legend: A accesses in the sequence.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from mawforge.cache.core import CacheStats, LayerStats, plan_groups
from mawforge.trace.record import Trace

ORACLES = ("belady", "belady-pinned")


@dataclass(frozen=True)
class AccessSeq:
    keys: np.ndarray  # [A] int64, layer * n_experts + expert
    sizes: np.ndarray  # [A] int64 block bytes
    record: np.ndarray  # [A] int64 layer-record index
    n_experts: int

    @property
    def layers(self) -> np.ndarray:  # [A]
        return self.keys // self.n_experts


def access_sequence(trace: Trace) -> AccessSeq:
    """The capacity-independent demand sequence of a trace."""
    e = trace.meta.n_experts
    rows_per_rec = np.diff(trace.rec_start)  # [R]
    row_rec = np.repeat(np.arange(len(rows_per_rec)), rows_per_rec)  # [N]
    row_layer = trace.rec_layer[row_rec].astype(np.int64)  # [N]
    code = (row_rec[:, None] * trace.meta.n_layers + row_layer[:, None]) * e \
        + trace.experts.astype(np.int64)  # [N, k]
    code = np.unique(code[trace.experts >= 0])  # sorted: record order, then expert id ascending (-1: skipped)
    key = code % (trace.meta.n_layers * e)
    record = code // (trace.meta.n_layers * e)
    sizes = trace.block_bytes.reshape(-1)[key]
    return AccessSeq(keys=key, sizes=sizes, record=record, n_experts=e)


def group_starts(seq: AccessSeq, capacity_bytes: int) -> np.ndarray:
    """[A] bool: True where a new pin group begins (same split as RouteDriver)."""
    starts = np.ones(len(seq.keys), dtype=bool)
    if len(starts) == 0:
        return starts
    starts[1:] = seq.record[1:] != seq.record[:-1]
    totals = np.bincount(seq.record, weights=seq.sizes)
    for rec in np.flatnonzero(totals > capacity_bytes):  # only records that must split
        idx = np.flatnonzero(seq.record == rec)
        for a, _ in plan_groups(seq.sizes[idx].tolist(), capacity_bytes):
            starts[idx[a]] = True
    return starts


def next_uses(keys: np.ndarray) -> list[int]:
    """For each position, the next position with the same key (len(keys) if none)."""
    n = len(keys)
    nxt = [n] * n
    last: dict[int, int] = {}
    for i in range(n - 1, -1, -1):
        k = keys[i]
        nxt[i] = last.get(k, n)
        last[k] = i
    return nxt


def belady(seq: AccessSeq, capacity_bytes: int, pinned: bool,
           nxt: list[int] | None = None) -> CacheStats:
    keys = seq.keys.tolist()
    sizes = seq.sizes.tolist()
    starts = group_starts(seq, capacity_bytes).tolist() if pinned else None
    nxt = next_uses(keys) if nxt is None else nxt
    n_layers = int(seq.layers.max()) + 1 if len(keys) else 0
    hits, misses, evictions, mat = ([0] * n_layers for _ in range(4))
    resident: dict[int, int] = {}  # key -> its next use
    size_of: dict[int, int] = {}
    heap: list[tuple[int, int]] = []  # (-next use, key), lazily invalidated
    group: set[int] = set()
    used = 0
    e = seq.n_experts
    for i, key in enumerate(keys):
        if pinned and starts[i]:
            group.clear()
        layer = key // e
        if key in resident:
            hits[layer] += 1
        else:
            size = sizes[i]
            stash = []
            while used + size > capacity_bytes:
                neg, victim = heapq.heappop(heap)
                if resident.get(victim) != -neg:
                    continue  # stale entry
                if victim in group:
                    stash.append((neg, victim))
                    continue
                del resident[victim]
                used -= size_of.pop(victim)
                evictions[victim // e] += 1
            for item in stash:
                heapq.heappush(heap, item)
            misses[layer] += 1
            mat[layer] += size
            size_of[key] = size
            used += size
        resident[key] = nxt[i]
        heapq.heappush(heap, (-nxt[i], key))
        if pinned:
            group.add(key)
        if len(heap) > 4 * len(resident) + 64:
            heap = [(-nu, k) for k, nu in resident.items()]
            heapq.heapify(heap)
    per_layer = tuple(LayerStats(layer, hits[layer], misses[layer], evictions[layer], mat[layer])
                      for layer in range(n_layers) if hits[layer] + misses[layer])
    return CacheStats(
        capacity_bytes=capacity_bytes, used_bytes=used, hits=sum(hits), misses=sum(misses),
        evictions=sum(evictions), materialized_bytes=sum(mat), prefetch_issued=0,
        prefetch_issued_bytes=0, prefetch_useful=0, prefetch_useful_bytes=0, prefetch_wasted=0,
        prefetch_wasted_bytes=0, prefetch_pending_bytes=0, prefetch_probes=0,
        prefetch_dropped=0, per_layer=per_layer)


def uniform_sizes(seq: AccessSeq) -> bool:
    """True when every accessed block has the same size (relaxed Belady is then a bound)."""
    return bool(len(seq.sizes) == 0 or np.all(seq.sizes == seq.sizes[0]))
