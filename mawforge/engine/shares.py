"""A batch's accounting: each sequence's share of the expert cache's counters (engine/batch.py
splits each layer's reads among the sequences that routed to them; the shares add up to the
totals, each read counted once)."""
from __future__ import annotations


# the expert cache's counters a request's telemetry takes deltas of (engine/generate.py _telemetry)
COUNTED = ("hits", "misses", "evictions", "materialized_bytes", "prefetch_issued_bytes", "prefetch_useful_bytes",
           "prefetch_wasted_bytes", "load_seconds", "prefetch_stall_seconds", "demand_loaded_bytes")


class SeqCache:
    """The expert cache as one sequence sees it: stats() are its share of the counters; the rest
    is the shared cache's."""

    def __init__(self, cache) -> None:
        self._cache = cache
        self.share = dict.fromkeys(COUNTED, 0)
        self.running: dict | None = None    # the counters when a step this sequence runs alone began

    def stats(self) -> dict:
        s = self._cache.stats()
        mine = dict(self.share)
        if self.running is not None:        # alone in a running step: all of its reads so far are this one's
            now = self._cache.counters()
            for k in COUNTED:
                mine[k] += now[k] - self.running[k]
        s.update(mine)
        return s

    def __getattr__(self, name):
        return getattr(self._cache, name)


def split(total, weights: list[int]) -> list:
    """total split in proportion to weights (integers exactly: the remainder to the first)."""
    w = sum(weights)
    if isinstance(total, float):
        return [total * x / w for x in weights]
    parts = [total * x // w for x in weights]
    parts[0] += total - sum(parts)
    return parts
