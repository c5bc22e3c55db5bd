"""The prompt cache's tensor side and the one call the generator makes for a prompt:

    logits, reuse = prefill(rt, prompt)    # [V]; reuse.cached: positions not run again
    ...                                    # decode
    rt.prompt_cache.note_decoded(context)  # row-exact runtimes: the answer's rows are live too
    reuse.release()                        # the request is over: its entry's pin goes

prefill() takes the longest usable cached prefix (engine/prompt_cache.py says which rows are
usable) from the live KV (the previous request's rows, still there: truncate to it, no copy) or
from a saved prompt (copy its rows and state in), runs the rest, and saves the prompt: rows of
every position, the recurrent state at its checkpoints and the last logits. Its bytes are
reserved in the store before the prefill runs and the entry becomes visible only once the
prefill finished and every copy is made, so an interrupted prefill leaves nothing a later
request could take for complete.

Granularity. Where the runtime is row-exact (`rows_exact`: every row a prefill writes is the
bits the decode step computes at its position, whatever chunk or wave the row ran in), any
prefix is reused, down to the token, and so are the rows the answer's decode steps wrote.
Elsewhere only whole prefill chunks are (a row's bits may depend on its chunk there).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from mawforge.byte_rules import prompt_entry_bytes
from mawforge.engine.prompt_cache import Entry, PromptStore, canonical, reusable
from mawforge.kernels import native
from mawforge.kernels.cpu import NATIVE_PARTS
from mawforge.models.kv import layer_layout


@dataclass
class Payload:
    rows: list[torch.Tensor]
    states: dict[int, list[list[torch.Tensor]]]     # checkpoint position -> recurrent state
    logits: torch.Tensor | None = None              # [V] float32: the last prompt token's


def rows_exact(rt) -> bool:
    """True where a prefill row's bits do not depend on the rows computed beside it: the model's
    whole layer is the shared code in native calls (models/fastpath.py plans its fused decode
    layer, router included), and every layer's experts are plain SwiGLU over GGUF blocks the
    native kernels take. Each of those calls computes a row alone (the integer GEMMs quantize and
    sum each row by itself; attend_rows gives each row attend_one's bits; route_topk and rms_norm
    go row by row; moe_ffn sums a token's experts in one fixed order), so a row computed in any
    chunk, wave or decode step is the same. tests/test_prompt_cache.py checks it on split prefills."""
    from mawforge.models.base import MoETransformer
    from gguf import GGMLQuantizationType as T
    model = rt.model
    fast = getattr(model, "decode_attention", None)
    if (fast is None or fast.whole is None or not fast.routes or model.experts.expert_fn() is not None
            or type(model).beside_experts is not MoETransformer.beside_experts or rt.cfg.args.dense_layers
            or getattr(rt.kv, "recurrent", False)):
        return False
    for lb in rt.index.layers:
        for t in lb.tensors:
            if t.codec not in NATIVE_PARTS or t.qtype not in T.__members__ or not native.available(T[t.qtype]):
                return False
    return True


class PromptCache:
    """One runtime's side of the cache: its configuration key, the store (one store may serve
    several runtimes: the key keeps their entries apart) and the live sequence."""

    def __init__(self, rt, store: PromptStore):
        self.rt, self.store = rt, store
        self.chunk = rt.opts.prefill_chunk
        # the reuse unit: one token where rows are exact in any chunk, else a whole prefill chunk
        self.granule = 1 if rows_exact(rt) else self.chunk
        # everything that changes a row's bits besides the token ids: the pack (weights, config,
        # rope and yarn settings), the KV dtype, the chunking (unless rows are exact in any
        # chunk), the device
        self.key = (rt.manifest.pack_digest, rt.plan.kv_dtype, "rows" if self.granule == 1 else self.chunk,
                    rt.device.type)
        self.recurrent = rt.kv.recurrent
        self.layout = layer_layout(rt.cfg)
        self.kv_dtype = rt.plan.kv_dtype
        self.live: tuple[int, ...] = ()      # the tokens whose rows the live KV holds (rt.kv.kept of them)

    def live_reusable(self, prompt: list[int]) -> int:
        """Positions of the live KV a new prompt may keep (attention only: a recurrent state
        cannot be cut back to a prefix)."""
        if self.recurrent or not self.live:
            return 0
        kept = min(self.rt.kv.kept, len(self.live))
        return reusable(self.live[:kept], min(canonical(len(self.live), self.granule), kept), prompt, self.granule)

    def note_decoded(self, context: list[int]) -> None:
        """After a request: where rows are exact, the rows its decode steps wrote (context: the
        prompt and the tokens generated; the KV holds rows of its first rt.kv.pos) are live too,
        so the next turn, which resends the answer, reuses them."""
        kv = self.rt.kv
        if (self.granule != 1 or self.recurrent or not self.live or kv.kept != len(self.live)
                or not len(self.live) <= kv.pos <= len(context) or tuple(context[:len(self.live)]) != self.live):
            return
        self.live, kv.kept = tuple(context[:kv.pos]), kv.pos

    def entry_for(self, prompt: list[int]) -> Entry:
        L, c = len(prompt), canonical(len(prompt), self.granule)
        checkpoints = tuple(sorted({c, L} - {0})) if self.recurrent else None
        nbytes = prompt_entry_bytes(self.layout, L, self.kv_dtype, len(checkpoints or ()), self.rt.cfg.vocab)
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
    entry, n = store.lookup(pc.key, prompt, pc.granule)
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
    L, c = len(prompt), canonical(len(prompt), pc.granule)
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
