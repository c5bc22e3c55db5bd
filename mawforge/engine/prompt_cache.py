"""The prompt cache's bookkeeping, torch-free: which cached prefix a prompt may reuse, and the
saved prompts kept in a byte budget (LRU, pinned while a request uses them). The tensor copies
live in engine/prompt_reuse.py; docs/prompt-cache.md says what is reused and why.

Exactness. A cached row is reused only where a cold prefill of the new prompt would compute the
same bits. The unit of reuse (`chunk` below) is the runtime's: one token where every row is
exact in any chunk and in a decode step (engine/prompt_reuse.rows_exact), else `prefill_chunk`,
since a row's bits may depend on the chunk it was computed in (a torch GEMM's blocking follows
its row count). With a whole chunk as the unit, reused rows are those of whole prefill chunks,
i.e. positions below the prompt's length rounded down to a chunk (`canonical`), and the prefill
of the rest starts at a chunk boundary as a cold one does. The one other reuse is the very same
prompt again: its rows, its end state and its last logits were computed as a cold prefill
computes them, so nothing is run at all.

Recurrent (gated delta-net) layers hold a state, not rows: an entry of a hybrid model is usable
only at a position whose state it saved (`checkpoints`: its canonical length and its end).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass


def common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def canonical(n_tokens: int, chunk: int) -> int:
    """The leading positions of a prefill of n_tokens that any longer prompt's cold prefill
    computes in the same chunks: n_tokens rounded down to a chunk."""
    return n_tokens // chunk * chunk


def reusable(tokens, canon: int, prompt, chunk: int, checkpoints: tuple[int, ...] | None = None,
             exact: bool = False) -> int:
    """How many leading positions of `prompt` a cached sequence (`tokens`, rows exact up to
    `canon`) may supply. exact: the sequence also keeps its end state and last logits, so the
    very same prompt reuses everything. checkpoints: for a recurrent model, the positions whose
    state was saved (None: attention only, any chunk boundary will do)."""
    if exact and len(tokens) == len(prompt) and tuple(tokens) == tuple(prompt):
        return len(prompt)
    limit = min(common_prefix(tokens, prompt), len(prompt) - 1, canon)   # one token left to give logits
    n = canonical(limit, chunk)
    if checkpoints is not None:
        n = max((p for p in checkpoints if p <= n and p % chunk == 0), default=0)
    return n


@dataclass(eq=False)
class Entry:
    """A saved prompt: its token ids, the rows of every position, the recurrent state at each
    checkpoint and the last logits (payload: engine/prompt_reuse.py's tensors)."""
    key: tuple
    tokens: tuple[int, ...]
    canon: int
    checkpoints: tuple[int, ...] | None     # None: no recurrent layers
    nbytes: int
    payload: object = None
    pins: int = 0
    ready: bool = False                     # payload complete: only then can a lookup find it

    def usable(self, prompt, chunk: int) -> int:
        return reusable(self.tokens, self.canon, prompt, chunk, self.checkpoints, exact=True)


@dataclass
class Counters:
    lookups: int = 0
    hits: int = 0                   # lookups that reused a prefix (live or saved)
    cached_tokens: int = 0          # prompt tokens not prefilled again
    saved: int = 0
    evictions: int = 0
    refused: int = 0                # prompts too large for the budget (or everything pinned)


class PromptStore:
    """Saved prompts of any number of sequences, keyed by (configuration key, token ids), in
    `budget` bytes. A lookup pins the entry it returns until release(); pinned entries are never
    evicted. Thread-safe, so a batching engine can share one store across sequences."""

    def __init__(self, budget: int):
        self.budget = budget
        self.entries: OrderedDict[int, Entry] = OrderedDict()      # least recently used first
        self.held = 0
        self.counters = Counters()
        self.lock = threading.Lock()

    def lookup(self, key: tuple, prompt, chunk: int) -> tuple[Entry | None, int]:
        """The entry that supplies the most positions of `prompt` and how many, pinned (None, 0: none)."""
        with self.lock:
            best, n = None, 0
            for e in self.entries.values():
                if e.ready and e.key == key:
                    m = e.usable(prompt, chunk)
                    if m > n:
                        best, n = e, m
            if best is not None:
                best.pins += 1
                self.entries.move_to_end(id(best))
            return best, n

    def release(self, e: Entry | None) -> None:
        if e is not None:
            with self.lock:
                e.pins = max(0, e.pins - 1)

    def has(self, key: tuple, tokens) -> bool:
        tokens = tuple(tokens)
        with self.lock:
            return any(e.key == key and e.tokens == tokens for e in self.entries.values())

    def admit(self, e: Entry) -> bool:
        """Make room for e (evicting least recently used unpinned entries, and entries of the same
        key that e supersedes) and hold its bytes; False, evicting nothing, when it cannot fit.
        The caller fills e.payload, then commit(e) (or drop(e) if the copy failed)."""
        with self.lock:
            if e.checkpoints is None:       # attention only: a saved prefix of e's tokens adds
                for old in [o for o in self.entries.values()     # nothing but its own exact repeat
                            if o.key == e.key and not o.pins and o.checkpoints is None
                            and len(o.tokens) < len(e.tokens) and e.tokens[:len(o.tokens)] == o.tokens]:
                    self._evict(old)
            free = self.budget - self.held
            victims = []
            for old in self.entries.values():
                if free >= e.nbytes:
                    break
                if not old.pins:
                    victims.append(old)
                    free += old.nbytes
            if free < e.nbytes:
                self.counters.refused += 1
                return False
            for old in victims:
                self._evict(old)
            self.entries[id(e)] = e
            self.held += e.nbytes
            e.pins += 1                     # its filler's pin: another sequence's admit cannot evict it half-filled
            return True

    def commit(self, e: Entry) -> None:
        with self.lock:
            e.ready = True
            e.pins = max(0, e.pins - 1)
            self.counters.saved += 1

    def drop(self, e: Entry) -> None:
        with self.lock:
            if self.entries.pop(id(e), None) is not None:
                self.held -= e.nbytes
            e.payload = None

    def _evict(self, e: Entry) -> None:
        del self.entries[id(e)]
        self.held -= e.nbytes
        e.payload = None
        self.counters.evictions += 1

    def count(self, cached: int) -> None:
        with self.lock:
            self.counters.lookups += 1
            self.counters.hits += cached > 0
            self.counters.cached_tokens += cached

    def report(self) -> dict:
        with self.lock:
            c = self.counters
            return {"budget_bytes": self.budget, "held_bytes": self.held, "entries": len(self.entries),
                    "pinned": sum(1 for e in self.entries.values() if e.pins), "lookups": c.lookups,
                    "hits": c.hits, "cached_tokens": c.cached_tokens, "saved": c.saved,
                    "evictions": c.evictions, "refused": c.refused}
