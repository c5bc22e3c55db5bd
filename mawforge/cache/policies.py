"""Eviction policies: pure Python, shared by the live expert cache and offline replay.

A policy only orders keys; `CacheCore` owns residency, bytes and pins and tells the policy
what happened through four hooks. Because replay drives the very same objects with the
very same call sequence, replaying a recorded trace reproduces live hit counts exactly.

Contract (what `CacheCore` guarantees and what a policy may assume):
- `bind(capacity_bytes)` is called once, before any other hook.
- `on_insert(key, nbytes, reuse)` when a block becomes resident; `on_hit(key, reuse)` on a
  demand hit (and on a recency-touching prefetch probe); `on_first_use(key, reuse)` on the
  first demand use of a prefetched block (by default a hit); `on_remove(key)` after a block
  leaves. `reuse` is the evidence of reuse inside one step: how many times its uniform share
  of the step's tokens the router sent to the block (`RouteDriver`; 0 where one token used it,
  as in every single-token decode step, and for prefetches).
- `victim(is_evictable)` is called only when the core will evict the returned key at once
  (and then call `on_remove`), so a policy may reorganise its queues while choosing.
  It returns None when every resident key is pinned. Probing residency (preserve-resident
  prefetch) never calls the policy, so it cannot disturb recency.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Callable, ClassVar

from mawforge.errors import RequestError

Key = tuple[int, int]  # (layer, expert)
Evictable = Callable[[Key], bool]


class Policy:
    """Base class and registry. Subclasses declare `class X(Policy, name="x")`."""

    name: ClassVar[str] = ""
    _registry: ClassVar[dict[str, type["Policy"]]] = {}

    def __init_subclass__(cls, name: str = "", **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if name:
            cls.name = name
            Policy._registry[name] = cls

    def __init__(self, arg: str | None = None) -> None:
        if arg is not None:
            raise RequestError(f"policy {self.name!r} takes no argument (got {arg!r})")
        self.capacity_bytes = 0

    @property
    def spec(self) -> str:
        return self.name

    def bind(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes

    def on_insert(self, key: Key, nbytes: int, reuse: float = 0.0) -> None:
        raise NotImplementedError

    def on_hit(self, key: Key, reuse: float = 0.0) -> None:
        raise NotImplementedError

    def on_first_use(self, key: Key, reuse: float = 0.0) -> None:
        self.on_hit(key, reuse)

    def on_remove(self, key: Key) -> None:
        raise NotImplementedError

    def victim(self, is_evictable: Evictable) -> Key | None:
        raise NotImplementedError


def policy_names() -> list[str]:
    return sorted(Policy._registry)


def make_policy(spec: str) -> Policy:
    """'lru', 'lfu', 'fifo', 's3fifo', 's3fifo-classic', 'random:SEED' (seed defaults to 0)."""
    name, _, arg = spec.strip().partition(":")
    cls = Policy._registry.get(name.lower())
    if cls is None:
        raise RequestError(f"unknown cache policy {spec!r}; choose from {', '.join(policy_names())}")
    return cls(arg or None)


class _OrderedPolicy(Policy):
    """Eviction order is the order of an OrderedDict, oldest first."""

    def __init__(self, arg: str | None = None) -> None:
        super().__init__(arg)
        self._order: OrderedDict[Key, None] = OrderedDict()

    def on_insert(self, key: Key, nbytes: int, reuse: float = 0.0) -> None:
        self._order[key] = None

    def on_remove(self, key: Key) -> None:
        del self._order[key]

    def victim(self, is_evictable: Evictable) -> Key | None:
        for key in self._order:
            if is_evictable(key):
                return key
        return None


class LRU(_OrderedPolicy, name="lru"):
    """Least recently used: a hit moves the key to the young end."""

    def on_hit(self, key: Key, reuse: float = 0.0) -> None:
        self._order.move_to_end(key)


class FIFO(_OrderedPolicy, name="fifo"):
    """First in, first out: hits change nothing."""

    def on_hit(self, key: Key, reuse: float = 0.0) -> None:
        pass


class LFU(Policy, name="lfu"):
    """Least frequently used among resident blocks (counts restart at 1 on re-insertion);
    ties go to the least recently used. Buckets of OrderedDicts keyed by count."""

    def __init__(self, arg: str | None = None) -> None:
        super().__init__(arg)
        self._count: dict[Key, int] = {}
        self._buckets: dict[int, OrderedDict[Key, None]] = {}

    def _put(self, key: Key, count: int) -> None:
        self._count[key] = count
        self._buckets.setdefault(count, OrderedDict())[key] = None

    def _take(self, key: Key) -> int:
        count = self._count.pop(key)
        bucket = self._buckets[count]
        del bucket[key]
        if not bucket:
            del self._buckets[count]
        return count

    def on_insert(self, key: Key, nbytes: int, reuse: float = 0.0) -> None:
        self._put(key, 1)

    def on_hit(self, key: Key, reuse: float = 0.0) -> None:
        self._put(key, self._take(key) + 1)

    def on_remove(self, key: Key) -> None:
        self._take(key)

    def victim(self, is_evictable: Evictable) -> Key | None:
        if not self._buckets:
            return None
        # Fast path: the lowest-count bucket almost always holds an unpinned key.
        for key in self._buckets[min(self._buckets)]:
            if is_evictable(key):
                return key
        for count in sorted(self._buckets):
            for key in self._buckets[count]:
                if is_evictable(key):
                    return key
        return None


class RandomPolicy(Policy, name="random"):
    """Seeded uniform random eviction among unpinned blocks ('random:SEED').

    Resident keys sit in a list in insertion order (swap-remove keeps it O(1)); the same
    seed and call sequence give the same victims, live or in replay."""

    def __init__(self, arg: str | None = None) -> None:
        super().__init__(None)
        try:
            self.seed = int(arg) if arg is not None else 0
        except ValueError:
            raise RequestError(f"random policy seed must be an integer, got {arg!r}") from None
        self._rng = random.Random(self.seed)
        self._keys: list[Key] = []
        self._index: dict[Key, int] = {}

    @property
    def spec(self) -> str:
        return f"random:{self.seed}"

    def on_insert(self, key: Key, nbytes: int, reuse: float = 0.0) -> None:
        self._index[key] = len(self._keys)
        self._keys.append(key)

    def on_hit(self, key: Key, reuse: float = 0.0) -> None:
        pass

    def on_remove(self, key: Key) -> None:
        i = self._index.pop(key)
        last = self._keys.pop()
        if last != key:
            self._keys[i] = last
            self._index[last] = i

    def victim(self, is_evictable: Evictable) -> Key | None:
        # Pins cover at most one layer group, so a few draws almost always succeed.
        for _ in range(8):
            if not self._keys:
                return None
            key = self._keys[self._rng.randrange(len(self._keys))]
            if is_evictable(key):
                return key
        candidates = [k for k in self._keys if is_evictable(k)]
        return candidates[self._rng.randrange(len(candidates))] if candidates else None


class S3FIFO(Policy, name="s3fifo"):
    """S3-FIFO (Yang et al., SOSP 2023, "FIFO queues are all you need"), byte-sized.

    Why this modern policy: a prefill chunk or a topic change touches many experts once;
    S3-FIFO sends new blocks to a small FIFO (10% of capacity bytes) and evicts them
    quickly unless they are hit again there, so one-time experts cannot flush the hot set
    that LRU would lose. It needs no per-hit reordering (a 2-bit counter), keeps no
    capacity-dependent adaptation state (unlike ARC's target p), and extends to variable
    block sizes by measuring queues in bytes. A ghost FIFO (keys only, up to 90% of
    capacity in bytes) readmits recently evicted blocks straight into the main queue.
    Pinned blocks are passed over in place; they keep their position and counter.

    Two rules for what S3-FIFO's counter cannot see (reuse evidence from `RouteDriver`):
    - a block that a step's tokens used at least ADMIT_REUSE times its uniform share (a prompt's
      common experts) enters the main queue at once, as a ghost hit does: reuse inside a
      prefill is evidence like reuse across steps, and without it a prefill's blocks all go
      through the small queue, so the cache it leaves holds the last layers' experts, not
      the prompt's common ones, and the first decode tokens miss on every early layer;
    - a prefetched block's first use is its first access, not a hit (a hit would promote
      every used prefetch, once-used ones included, to the main queue).
    Replayed on the full-size file's route traces this reads 9-15% fewer bytes than the
    published rule (`s3fifo-classic`) and 17-27% fewer than LRU (benchmarks/RESULTS.md, "an
    expert cache that sees reuse inside a step"). LFU reads fewer than both without prefetch
    but many more with it: a prefetched block enters with the lowest count and is evicted first.
    """

    SMALL_FRACTION = 0.10
    MAX_FREQ = 3
    ADMIT_REUSE = 1.5

    def __init__(self, arg: str | None = None) -> None:
        super().__init__(arg)
        self._small: OrderedDict[Key, int] = OrderedDict()  # key -> nbytes, oldest first
        self._main: OrderedDict[Key, int] = OrderedDict()
        self._ghost: OrderedDict[Key, int] = OrderedDict()
        self._freq: dict[Key, int] = {}
        self._small_bytes = self._ghost_bytes = 0

    def on_insert(self, key: Key, nbytes: int, reuse: float = 0.0) -> None:
        self._freq[key] = 0
        if key in self._ghost:
            self._ghost_bytes -= self._ghost.pop(key)
            self._main[key] = nbytes
        elif reuse >= self.ADMIT_REUSE:
            self._main[key] = nbytes
        else:
            self._small[key] = nbytes
            self._small_bytes += nbytes

    def on_hit(self, key: Key, reuse: float = 0.0) -> None:
        self._freq[key] = min(self._freq[key] + 1, self.MAX_FREQ)

    def on_first_use(self, key: Key, reuse: float = 0.0) -> None:
        # a prefetched block's first use is its first access, not a reuse: no count (a count
        # would promote every used prefetch to the main queue, once-used blocks included)
        if reuse >= self.ADMIT_REUSE and key in self._small:
            self._small_bytes -= self._small[key]
            self._main[key] = self._small.pop(key)

    def on_remove(self, key: Key) -> None:
        del self._freq[key]
        if key in self._small:
            nbytes = self._small.pop(key)
            self._small_bytes -= nbytes
            self._ghost[key] = nbytes
            self._ghost_bytes += nbytes
            limit = self.capacity_bytes * (1 - self.SMALL_FRACTION)
            while self._ghost_bytes > limit and self._ghost:
                self._ghost_bytes -= self._ghost.popitem(last=False)[1]
        else:
            del self._main[key]

    def victim(self, is_evictable: Evictable) -> Key | None:
        while True:
            if self._small_bytes >= self.SMALL_FRACTION * self.capacity_bytes:
                key = next((k for k in self._small if is_evictable(k)), None)
                if key is not None:
                    if self._freq[key] == 0:
                        return key
                    # Hit while in the small queue: promote to main with a fresh counter.
                    self._small_bytes -= self._small[key]
                    self._main[key] = self._small.pop(key)
                    self._freq[key] = 0
                    continue
            key = next((k for k in self._main if is_evictable(k)), None)
            if key is None:
                # Main is empty or pinned; fall back to anything unpinned in small.
                return next((k for k in self._small if is_evictable(k)), None)
            if self._freq[key] == 0:
                return key
            self._freq[key] -= 1
            self._main.move_to_end(key)


class S3FIFOClassic(S3FIFO, name="s3fifo-classic"):
    """S3-FIFO as published, blind to reuse inside a step: every new block (ghosts aside) enters
    the small queue, and a prefetched block's first use counts as a hit. Kept to replay against
    the default (`mawforge replay --policies s3fifo,s3fifo-classic`)."""

    ADMIT_REUSE = float("inf")

    def on_first_use(self, key: Key, reuse: float = 0.0) -> None:
        self.on_hit(key, reuse)
