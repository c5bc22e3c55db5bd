"""The live expert cache: slot storage mirroring the torch-free CacheCore's decisions.

Every hit/miss/evict decision is made by `RouteDriver`/`CacheCore` (shared with replay);
this class only frees the storage of evicted blocks and reads misses from the ExpertStore into
page-aligned slots. It does not compute: the model's MoE block (models/moe.py) asks `resident`
for each group's blocks and computes them. Slots are recycled by size class
(blocks differ in size by layer), and the bytes held never exceed the budget.

Legend: T tokens, C hidden, k experts per token.
"""
from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Iterator

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

from mawforge.cache.core import CacheCore, check_capacity
from mawforge.cache.driver import RouteDriver
from mawforge.cache.observer import CacheObserver
from mawforge.cache.policies import make_policy
from mawforge.cache.prefetchers import make_prefetcher
from mawforge.cache.store import ExpertStore, SlotMemory
from mawforge.codecs import quants
from mawforge.pack.manifest import ExpertIndex

Key = tuple[int, int]


class _Slot:
    __slots__ = ("mem", "dev", "size", "weights", "device")

    def __init__(self, size: int, device: torch.device):
        self.size, self.device = size, device
        self.mem = SlotMemory(size)
        self.dev = self._device_buffer()
        self.weights: dict[str, quants.PackedWeight] = {}

    def _device_buffer(self) -> torch.Tensor:
        """What the views are made over: the host memory itself on the CPU, else a device copy."""
        if self.device.type == "cpu":
            return self.mem.host
        return torch.empty(self.size, dtype=torch.uint8, device=self.device)

    @property
    def host(self) -> torch.Tensor:
        return self.mem.host

    def resize(self, size: int) -> None:
        """A free slot (no tensors over it) of another size class, reshaped for a block of `size`."""
        self.dev = None
        self.mem.resize(size)
        self.size = size
        self.dev = self._device_buffer()

    def close(self) -> None:
        self.dev = None
        self.mem.close()


class ExpertCache:
    def __init__(self, store: ExpertStore, index: ExpertIndex, capacity_bytes: int, top_k: int,
                 device: torch.device, policy: str = "s3fifo", prefetch: str | None = None, recorder=None):
        self.store, self.index, self.device = store, index, device
        # what happens to the cache, told to every observer in order (CacheObserver): the route
        # trace recorder (--trace-out), the dashboard's request traces, speculation's route tap
        self.observers: list[CacheObserver] = [recorder] if recorder is not None else []
        self.slot_bytes = [lb.slot_nbytes for lb in index.layers]
        self.minimum = check_capacity(capacity_bytes, self.slot_bytes, top_k)
        self.capacity = capacity_bytes
        self.core = CacheCore(capacity_bytes, make_policy(policy))
        self.driver = RouteDriver(self.core, self.block_bytes, make_prefetcher(prefetch), index.n_experts)
        self.slots: dict[Key, _Slot] = {}
        self.free: dict[int, list[_Slot]] = {}
        self.held = 0                       # bytes of all slots, in use or free
        self.peak_held = 0
        self.reshaped = 0                   # free slots turned into another size class (SlotMemory.resize)
        self.pending: dict[Key, Future] = {}
        self.load_seconds = 0.0             # wall time spent waiting on demand loads
        self.prefetch_stall_seconds = 0.0   # wall time computing waited on in-flight prefetches
        self.demand_loaded_bytes = 0
        self.prefill_keys: set[Key] = set()  # distinct blocks prefill steps routed to (reset per request)
        self.n_blocks = sum(len(lb.offsets) for lb in index.layers)
        # per layer, each tensor's (name, make(buf) -> PackedWeight): the views' checks made once
        self._templates = [[(t.name, quants.get_codec(t.codec).view_plan(
                                self.slot_bytes[layer], [p.offset for p in t.parts],
                                [quants.PartSpec(p.name, p.dtype, p.shape) for p in t.parts], QT[t.qtype],
                                tuple(t.shape)))
                            for t in lb.tensors] for layer, lb in enumerate(index.layers)]

    # ---- accounting shared with replay -----------------------------------------------
    def block_bytes(self, layer: int, expert: int) -> int:
        return self.slot_bytes[layer]

    def begin_step(self, kind: str, n_tokens: int) -> None:
        for o in self.observers:
            o.begin_step(kind, n_tokens, prefetch=self.driver.enabled)
        self._run_prefetch(self.driver.begin_step(kind, n_tokens))

    def end_step(self) -> None:
        self._run_prefetch(self.driver.end_step())

    # ---- storage ---------------------------------------------------------------------
    def _release(self, key: Key) -> None:
        fut = self.pending.pop(key, None)
        if fut is not None:
            fut.exception()     # wait for the read; a failed prefetch of a block dropped unused is moot
        slot = self.slots.pop(key)
        slot.weights = {}
        self.free.setdefault(slot.size, []).append(slot)

    def _take(self, size: int) -> _Slot:
        """A slot for a block of `size` bytes: a free one of that size, else a new one while the
        budget has room, else a free slot of another size class reshaped (its pages kept, see
        SlotMemory), giving back whole free slots first where the reshape would not fit."""
        pool = self.free.get(size)
        if pool:
            return pool.pop()
        while self.held + size > self.capacity:
            other = next((s for s in self.free if self.free[s]), None)
            if other is None:
                raise AssertionError("expert cache storage would exceed its budget")
            slot = self.free[other].pop()
            if self.held - other + size <= self.capacity:
                slot.resize(size)
                self.held += size - other
                self.peak_held = max(self.peak_held, self.held)
                self.reshaped += 1
                return slot
            slot.close()
            self.held -= other
        self.held += size
        self.peak_held = max(self.peak_held, self.held)
        assert self.held <= self.capacity, "expert cache holds more than its budget"
        return _Slot(size, self.device)

    def _bind(self, key: Key, slot: _Slot) -> None:
        layer = key[0]
        if slot.dev is not slot.host:
            slot.dev.copy_(slot.host, non_blocking=False)
        slot.weights = {name: make(slot.dev) for name, make in self._templates[layer]}
        self.slots[key] = slot

    def _load(self, keys: tuple[Key, ...], asynchronous: bool = False) -> None:
        jobs = []
        for key in keys:
            slot = self._take(self.slot_bytes[key[0]])
            self.slots[key] = slot
            jobs.append((key, slot))
        if asynchronous:
            for key, slot in jobs:
                self.pending[key] = self.store.submit(key[0], key[1], slot.mem.buf)
        else:
            t0 = time.perf_counter()
            self.store.read_many([(k[0], k[1], s.mem.buf) for k, s in jobs])
            for key, slot in jobs:
                self._bind(key, slot)
            self.load_seconds += time.perf_counter() - t0
            self.demand_loaded_bytes += sum(s.size for _, s in jobs)

    def _ready(self, key: Key) -> _Slot:
        """The block's slot once its read has arrived. A prefetch's reader thread only reads; its
        views are made here, on the engine thread, so the readers hold the GIL as little as they
        can (each grab of it on a 2-core machine waits for, or delays, the compute thread)."""
        fut = self.pending.pop(key, None)
        if fut is not None:
            late, t0 = not fut.done(), time.perf_counter()
            fut.result()
            if late:
                self.prefetch_stall_seconds += time.perf_counter() - t0   # a prefetch that arrived late
            self._bind(key, self.slots[key])
        return self.slots[key]

    def _run_prefetch(self, plan) -> None:
        if not plan:
            return
        for key in plan.evicted:
            self._release(key)
        if plan.loads:
            self._load(plan.loads, asynchronous=True)

    # ---- what the model's MoE block asks (models/moe.py computes) --------------------
    def resident(self, layer: int, idx_np: np.ndarray, w_np: np.ndarray) -> Iterator[list[Key]]:
        """Per group of this layer's routed experts (idx/w [T, k]): evict, read the misses, then
        yield the group's keys, whose blocks `weights(key)` returns. After the last group the
        layer's prefetch runs (the consumer must exhaust the generator)."""
        for o in self.observers:
            o.record(layer, idx_np, w_np)
        for group in self.driver.layer(layer, idx_np, w_np):
            if self.driver.kind == "prefill":
                self.prefill_keys.update(group.keys)
            for key in group.evicted:
                self._release(key)
            if group.misses:
                self._load(group.misses)
            yield list(group.keys)
        self._run_prefetch(self.driver.after_layer(layer))

    def holds(self, key: Key) -> bool:
        """The block is resident or on its way (a prefetch in flight); touches nothing."""
        return key in self.core

    def weights(self, key: Key) -> dict[str, quants.PackedWeight]:
        """The resident block's tensors (kind -> PackedWeight), once its read has arrived."""
        return self._ready(key).weights

    def preload(self) -> int:
        """Fill the cache with blocks in (layer, expert) order until it is full (a warm start,
        e.g. at 100% cache). Goes through the prefetch path, so it is counted as prefetch."""
        keys = [(l, e) for l, lb in enumerate(self.index.layers) for e in range(len(lb.offsets))]
        room = self.capacity - self.core.used_bytes
        take = []
        for k in keys:
            if self.block_bytes(*k) > room:
                break
            room -= self.block_bytes(*k)
            take.append(k)
        plan = self.driver.prefetch(take)
        for key in plan.evicted:
            self._release(key)
        self._load(plan.loads)
        return len(plan.loads)

    def lookahead(self, keys: list[Key]) -> None:
        """Live prefetch of given keys (next-layer router lookahead), through the same budget;
        a route trace records the keys, so replay issues the same prefetch at the same point."""
        for o in self.observers:
            o.lookahead(keys)
        self._run_prefetch(self.driver.lookahead(keys))

    def prefill_needed_bytes(self) -> int:
        """Bytes of the distinct blocks prefill routed to since `prefill_keys` was cleared: what
        a prefill that read each needed block once would read."""
        return sum(self.slot_bytes[layer] for layer, _ in self.prefill_keys)

    def complete(self) -> bool:
        """Every block of the model is resident. It then stays so (nothing is left to load, so
        nothing is evicted), and a prefetch could only probe blocks already there."""
        return len(self.core) == self.n_blocks

    def read_wait_seconds(self) -> float:
        """Wall time the compute has waited on expert reads so far: demand loads of misses plus
        prefetches that had not arrived. Cheap (two floats): read around every decode step."""
        return self.load_seconds + self.prefetch_stall_seconds

    def counters(self) -> dict:
        """stats()' running counters only (cheap: engine/batch.py reads them around each layer)."""
        s = self.core.totals()
        s.update(load_seconds=self.load_seconds, prefetch_stall_seconds=self.prefetch_stall_seconds,
                 demand_loaded_bytes=self.demand_loaded_bytes)
        return s

    def stats(self) -> dict:
        s = self.core.stats().to_dict()
        s.update(capacity_bytes=self.capacity, held_bytes=self.held, peak_held_bytes=self.peak_held,
                 reshaped_slots=self.reshaped,
                 minimum_bytes=self.minimum, load_seconds=self.load_seconds,
                 prefetch_stall_seconds=self.prefetch_stall_seconds,
                 demand_loaded_bytes=self.demand_loaded_bytes)
        return s

    def close(self) -> None:
        for fut in self.pending.values():
            fut.exception()     # wait; a prefetch that failed was never used (a use raises its error)
        self.pending.clear()
