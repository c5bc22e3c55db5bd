"""The prompt cache's tensor side and the one call the generator makes for a prompt:

    logits, reuse = prefill(rt, prompt)    # [V]; reuse.cached: positions not run again
    ...                                    # decode
    reuse.release()                        # the request is over: its entry's pin goes

prefill() takes the longest usable cached prefix (engine/prompt_cache.py says which rows are
usable) from the live KV (the previous prompt's rows, still there: truncate to it, no copy) or
from a saved prompt (copy its rows and state in), runs the rest from a chunk boundary, and saves
the prompt: rows of every position, the recurrent state at its checkpoints and the last logits.
Its bytes are reserved in the store before the prefill runs and the entry becomes visible only
once the prefill finished and every copy is made, so an interrupted prefill leaves nothing a
later request could take for complete.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from mawforge.byte_rules import prompt_entry_bytes
from mawforge.engine.prompt_cache import Entry, PromptStore, canonical, reusable
from mawforge.models.kv import layer_layout


@dataclass
class Payload:
    rows: list[torch.Tensor]
    states: dict[int, list[list[torch.Tensor]]]     # checkpoint position -> recurrent state
    logits: torch.Tensor | None = None              # [V] float32: the last prompt token's


class PromptCache:
    """One runtime's side of the cache: its configuration key, the store (one store may serve
    several runtimes: the key keeps their entries apart) and the live sequence."""

    def __init__(self, rt, store: PromptStore):
        self.rt, self.store = rt, store
        # everything that changes a row's bits besides the token ids: the pack (weights, config,
        # rope and yarn settings), the KV dtype, the chunking, the device
        self.key = (rt.manifest.pack_digest, rt.plan.kv_dtype, rt.opts.prefill_chunk, rt.device.type)
        self.chunk = rt.opts.prefill_chunk
        self.recurrent = rt.kv.recurrent
        self.layout = layer_layout(rt.cfg)
        self.itemsize = torch.empty(0, dtype=getattr(torch, rt.plan.kv_dtype)).element_size()
        self.live: tuple[int, ...] = ()      # the prompt whose rows the live KV holds (rt.kv.kept of them)

    def live_reusable(self, prompt: list[int]) -> int:
        """Positions of the live KV a new prompt may keep (attention only: a recurrent state
        cannot be cut back to a prefix)."""
        if self.recurrent or not self.live:
            return 0
        kept = min(self.rt.kv.kept, len(self.live))
        return reusable(self.live[:kept], min(canonical(len(self.live), self.chunk), kept), prompt, self.chunk)

    def entry_for(self, prompt: list[int]) -> Entry:
        L, c = len(prompt), canonical(len(prompt), self.chunk)
        checkpoints = tuple(sorted({c, L} - {0})) if self.recurrent else None
        nbytes = prompt_entry_bytes(self.layout, L, self.itemsize, len(checkpoints or ()), self.rt.cfg.vocab)
        return Entry(self.key, tuple(prompt), c, checkpoints, nbytes, Payload([], {}))

    def report(self) -> dict:
        return self.store.report()


@dataclass
class Reuse:
    store: PromptStore | None = None
    entry: Entry | None = None
    cached: int = 0
    source: str = "none"            # "live", "saved" or "none"

    def release(self) -> None:
        if self.store is not None:
            self.store.release(self.entry)
            self.entry = None


def prefill(rt, prompt: list[int]) -> tuple[torch.Tensor, Reuse]:
    """Reset the runtime for a new sequence and leave `prompt` in its KV; the last prompt
    token's logits [V] and what was reused."""
    pc = rt.prompt_cache
    keeps_hidden = getattr(rt.model, "keeps_hidden", None)
    if pc is None or (keeps_hidden is not None and keeps_hidden()):
        # off, or MTP drafting, which reads the target's hidden state at every prompt position
        rt.reset()
        return rt.forward(prompt)[-1], Reuse()
    store = pc.store
    n_live = pc.live_reusable(prompt)
    entry, n = store.lookup(pc.key, prompt, pc.chunk)
    if entry is not None and n <= n_live:
        store.release(entry)
        entry, n = None, n_live
    reuse = Reuse(store, entry, max(n, n_live), "saved" if entry is not None else "live" if n_live else "none")
    pc.live = ()                         # nothing is live until this prefill has finished
    new = pc.entry_for(prompt) if not store.has(pc.key, prompt) else None
    if new is not None and not store.admit(new):
        new = None
    try:
        logits = _run(rt, pc, prompt, entry, reuse.cached, new)
        if new is not None:
            new.payload.rows = rt.kv.export_rows(len(prompt))
            new.payload.logits = logits.detach().float().clone()
            store.commit(new)
    except BaseException:
        reuse.release()
        if new is not None:
            store.drop(new)
        raise
    pc.live, rt.kv.kept = tuple(prompt), len(prompt)
    store.count(reuse.cached)
    return logits, reuse


def _run(rt, pc: PromptCache, prompt: list[int], entry: Entry | None, n: int, new: Entry | None) -> torch.Tensor:
    """Bring the KV to n reused positions, run the rest, and leave the recurrent state at each
    of new's checkpoints in its payload."""
    L, c = len(prompt), canonical(len(prompt), pc.chunk)
    if entry is not None:
        rt.reset()
        rt.kv.import_rows(entry.payload.rows, n)
        if pc.recurrent:
            rt.kv.import_state(entry.payload.states[n])
        if n == L:                       # the same prompt again: its end state and logits are saved
            return entry.payload.logits.clone()
    else:
        rt.reset(n)
    keep = pc.recurrent and new is not None
    if keep and c == n and c:
        new.payload.states[c] = rt.kv.export_state()
    start = n
    if pc.recurrent and n < c < L:       # stop at the chunk boundary a longer prompt can resume from
        rt.forward(prompt[n:c])
        if keep:
            new.payload.states[c] = rt.kv.export_state()
        start = c
    logits = rt.forward(prompt[start:])[-1]
    if keep:
        new.payload.states[L] = rt.kv.export_state()
    return logits
