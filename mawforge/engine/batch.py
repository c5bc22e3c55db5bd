"""Continuous batching: every active sequence advances in one step, and each routed expert block
is read and computed once for all the sequences of the step that routed to it.

Each active request runs the one generator (engine/generate.py `generate`, prompt cache and all)
in a greenlet of its own, on a `Sequence`: the runtime seen through a KV cache slot of its own.
A sequence's forward does not run at once: it parks at the step boundary, and the scheduler
(`Batch.step`, run by one OS thread: the server's engine thread) starts a step once every active
sequence is parked there. Inside the step each sequence runs its own layer code exactly as alone
(its mixer over its own KV, its norms, its router: the fused one-token path with buffers of its
own), and parks again at the MoE block (models/moe.py `gate`) with its rows. When every sequence
of the step has parked at that layer, the block runs once over all their rows (the expert cache
is asked for the union of their blocks: one read and one expert GEMM per block), each sequence
takes its rows back and goes on to its next layer. A prompt runs one piece of whole attention
chunks a step while others are active (about 256 tokens; alone, whole prefill waves as without
batching), so a long prompt does not freeze the others' streams, and its piece's rows share the
step's expert reads with theirs.

Exact: a sequence runs the code it runs alone; only the MoE block sees rows of several, and the
native expert kernels give a row the same bits at any row count (kernels/native `moe_ffn`), with
a row's experts summed in ascending id order either way (cache/driver.py groups).
tests/conformance/test_batch_rows.py holds every architecture row to it.

Accounting: one step is one expert-cache step (a route trace records the step's rows together).
A layer's counter deltas (hits, misses, bytes read, ...) are split among its sequences in
proportion to their rows (each row routed the same k experts), and the rest of a step's (router
lookahead prefetch) by tokens, so a request's telemetry is its share and the totals count each
read once.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import greenlet
import torch

from mawforge.engine.prompt_reuse import PromptCache
from mawforge.errors import Cancelled, MawError
from mawforge.kernels import native
from mawforge.models.fastpath import DecodeAttention
from mawforge.models.kv import KVCache
from mawforge.engine.runtime import check_tokens
from mawforge.engine.shares import COUNTED, SeqCache, split

class Sequence:
    """A runtime for one request of a batch: its own KV cache (and fused decode path bound to
    it), its own view of the prompt cache's live rows and of the expert cache's counters; the
    model, weights, expert cache and tokenizer are the runtime's. Its forward runs in the batch's
    steps."""

    def __init__(self, rt, batch: "Batch", slot: int) -> None:
        self._rt, self.batch, self.slot = rt, batch, slot
        if slot == 0:                      # the runtime's own KV and prompt-cache side
            self.kv, self.prompt_cache = rt.kv, rt.prompt_cache
        else:
            self.kv = KVCache.for_config(rt.cfg, rt.opts.context, rt.plan.kv_dtype, rt.device)
            if rt.model.decode_attention is not None:
                self.kv.fast = DecodeAttention.plan(rt.model)
            self.prompt_cache = PromptCache(self, rt.prompt_cache.store) if rt.prompt_cache is not None else None
        self.cache = SeqCache(rt.cache)
        self.interrupt = None               # generate()'s cancelled() while a prompt runs (Runtime's too)
        self.job = None                     # the server's job running here (serve/batching.py), if any

    def __getattr__(self, name):
        return getattr(self._rt, name)

    def reset(self, keep: int = 0) -> None:
        self.kv.truncate(keep)

    def forward(self, tokens: list[int], all_logits: bool = False, kind: str | None = None) -> torch.Tensor:
        """Runtime.forward's contract, run in the batch's steps (a prompt one piece a step)."""
        check_tokens(tokens, self.kv, self.cfg.vocab)
        outs, i, stop = [], 0, self.interrupt if len(tokens) > 1 else None

        def on_layer(layer: int) -> None:   # a cancelled prompt stops at its next layer (Runtime's rule)
            if stop():
                raise Cancelled("the request was cancelled during its prompt")
        while i < len(tokens):
            n = self.batch.begin(self, len(tokens) - i, kind)
            t = torch.tensor(tokens[i:i + n], dtype=torch.long, device=self.device)
            logits = self.model.forward(t, self.kv.pos, self.kv, all_logits=all_logits, chunk=self.opts.prefill_chunk,
                                        on_layer=on_layer if stop is not None else None)
            self.kv.commit(n)
            outs.append(logits)
            i += n
        return torch.cat(outs) if all_logits else outs[-1]


@dataclass
class _Row:
    seq: Sequence
    g: greenlet.greenlet
    n: int                    # tokens this step
    decode: bool
    park: tuple | None = None           # ("experts", layer, x, idx, w) while parked at a MoE block
    out: object = None                  # what the row's greenlet switched back with last


@dataclass
class StepReport:
    sequences: int = 0
    tokens: int = 0
    groups: list = field(default_factory=list)      # sequences per expert call, decode groups


class Batch:
    """The sequences of one runtime and the scheduler that steps them. `seqs[i]` is slot i."""

    def __init__(self, rt, max_batch: int, piece: int | None = None) -> None:
        if max_batch < 1:
            raise MawError(f"--max-batch must be at least 1, got {max_batch}")
        chunk = rt.opts.prefill_chunk
        self.rt, self.chunk = rt, chunk
        self.wave = max(chunk, rt.opts.prefill_wave // chunk * chunk)
        # a prompt's piece per step while others stream: whole attention chunks (the same query
        # chunks as alone), about 256 tokens
        self.piece = piece or max(chunk, 256 // chunk * chunk)
        self.seqs = [Sequence(rt, self, i) for i in range(max_batch)]
        self.main: greenlet.greenlet | None = None
        self._stepping: dict[greenlet.greenlet, _Row] = {}
        self._attributed: dict = {}         # the running step's counter deltas already given to sequences
        self.last = StepReport()
        self.peak = 0                       # the most sequences one step has run (telemetry, tests)
        self.steps = 0
        rt.model.experts.gate = self._gate
        rt.model.gate = self._logits_gate
        for fast in {id(f): f for f in [rt.model.decode_attention] + [q.kv.fast for q in self.seqs] if f}.values():
            fast.gate = self._dense_gate
        self._head_rows = _head_takes_rows(rt.model)

    # ---- the sequence side (runs in a request's greenlet) ---------------------------------
    def begin(self, seq: Sequence, remaining: int, kind: str | None) -> int:
        """Park at the step boundary; returns how many of the remaining tokens this step runs."""
        if self.main is None or greenlet.getcurrent() is self.main:
            raise MawError("a batch sequence ran outside its scheduler")
        return self.main.switch(("begin", seq, remaining, kind))

    def _alone(self) -> bool:
        """True where the running greenlet computes at once: outside a step (a draft model's
        call), or the only sequence left in it (nobody to share with: no parking)."""
        return len(self._stepping) < 2 or greenlet.getcurrent() not in self._stepping

    def _gate(self, layer: int, x, idx, w):
        row = self._stepping.get(greenlet.getcurrent())
        if row is None or row.seq.cache.running is not None:
            return None                     # outside a step (a draft model's call), or alone in it: now
        if len(self._stepping) < 2:         # the only sequence left in the step: now, counted as its own
            return self._experts_now(row, layer, x, idx, w)
        return self.main.switch(("experts", layer, x, idx, w))

    def _experts_now(self, row: _Row, layer: int, x, idx, w):
        cache = self.rt.cache
        s0 = cache.counters()
        y = self.rt.model.experts.compute(layer, x, idx, w)
        s1 = cache.counters()
        for k in COUNTED:
            d = s1[k] - s0[k]
            self._attributed[k] += d
            row.seq.cache.share[k] += d
        return y

    def _dense_gate(self, fast, layer: int, h, pos: int, cos, sin):
        return None if self._alone() else self.main.switch(("dense", layer, fast, h, pos, cos, sin))

    def _logits_gate(self, model, rows):
        if self._alone() or model is not self.rt.model:
            return None
        return self.main.switch(("logits", rows))

    # ---- the scheduler side (runs in the engine thread's main greenlet) -------------------
    def run_all(self, works: list) -> list:
        """Run each work(seq) -> result as a sequence of this batch, up to len(seqs) at once
        (the others start as slots free), stepping until every one has returned; the results in
        order. A work that raises makes this raise it once the others have finished."""
        results, errors = [None] * len(works), []
        free, todo, running, parked = list(range(len(self.seqs))), list(enumerate(works)), {}, {}

        def body(i, work, seq):
            try:
                results[i] = work(seq)
            except BaseException as e:       # noqa: BLE001  (re-raised below, after the others ran)
                errors.append(e)
        while todo or running:
            while free and todo:
                i, work = todo.pop(0)
                slot = free.pop(0)
                g = self.spawn(lambda i=i, work=work, seq=self.seqs[slot]: body(i, work, seq))
                running[g] = slot
                out = self.advance(g)
                if out is not None:
                    parked[g] = out
            if parked:
                parked = self.step(parked)
            for g in [g for g in running if g.dead]:
                free.append(running.pop(g))
                parked.pop(g, None)
        if errors:
            raise errors[0]
        return results


    def spawn(self, fn) -> greenlet.greenlet:
        """A greenlet for one request's work; `advance` runs it to its first park."""
        self.main = greenlet.getcurrent()
        return greenlet.greenlet(fn, parent=self.main)

    def advance(self, g: greenlet.greenlet):
        """Start g and run it until it parks (returns ("begin", seq, remaining, kind)) or ends (None)."""
        out = g.switch()
        return out if not g.dead else None

    def step(self, parked: dict[greenlet.greenlet, tuple]) -> dict[greenlet.greenlet, tuple]:
        """One step over every sequence parked at "begin"; returns where each parks next (the
        ones that ended are left out)."""
        rows, alone = [], len(parked) == 1
        for g, (_, seq, remaining, kind) in parked.items():
            decode = remaining == 1 and kind == "decode"
            n = remaining if decode else min(remaining, self.wave if alone else self.piece)
            rows.append(_Row(seq, g, n, decode))
        rt, cache = self.rt, self.rt.cache
        kind = "decode" if all(r.decode for r in rows) else "prefill"
        tokens = sum(r.n for r in rows)
        self.last = StepReport(len(rows), tokens)
        self.peak, self.steps = max(self.peak, len(rows)), self.steps + 1
        if cache.complete():
            cache.driver.enabled = False    # resident: nothing to prefetch (Runtime.forward)
        else:
            cache.driver.enabled = True
        if rt.governor is not None:
            rt.governor.release()           # all threads: a step's speed depends on its rows
        before = cache.counters()
        attributed = self._attributed = dict.fromkeys(COUNTED, 0)
        if len(rows) == 1:                  # alone: no parking, no per-layer counting (SeqCache.stats)
            rows[0].seq.cache.running = before
        cache.begin_step(kind, tokens)
        mode = torch.inference_mode()       # as Runtime.forward: the sequences' model code runs inside the step
        mode.__enter__()
        try:
            self._stepping.update((r.g, r) for r in rows)     # all of them first: none runs alone
            for r in rows:
                self._resume(r, r.n)
            while True:
                waiting = [r for r in rows if r.park is not None]
                if not waiting:
                    break
                stage = min(_stage(r.park) for r in waiting)
                group = [r for r in waiting if _stage(r.park) == stage]
                kind = group[0].park[0]
                if kind == "experts":
                    self._run_group(group[0].park[1], group, attributed)
                elif kind == "dense":
                    self._run_dense(group)
                else:
                    self._run_logits(group)
        finally:
            mode.__exit__(None, None, None)
            for r in rows:
                self._stepping.pop(r.g, None)
                r.seq.cache.running = None
            cache.end_step()
        after = cache.counters()
        for k in COUNTED:                   # what no group took (lookahead prefetch): by tokens
            for r, part in zip(rows, split(after[k] - before[k] - attributed[k], [r.n for r in rows])):
                r.seq.cache.share[k] += part
        return {r.g: r.out for r in rows if not r.g.dead}

    def _resume(self, r: _Row, value, throw: BaseException | None = None) -> None:
        out = r.g.throw(throw) if throw is not None else r.g.switch(value)
        r.out = None if r.g.dead else out
        r.park = out if (not r.g.dead and isinstance(out, tuple) and out[0] in PARKS) else None
        if r.park is None:
            self._stepping.pop(r.g, None)   # its forward's piece is done (parked at "begin") or it ended

    def _run_group(self, layer: int, group: list[_Row], attributed: dict) -> None:
        cache = self.rt.cache
        xs = [r.park[2] for r in group]
        x = xs[0] if len(group) == 1 else torch.cat(xs)
        idx = group[0].park[3] if len(group) == 1 else torch.cat([r.park[3] for r in group])
        w = group[0].park[4] if len(group) == 1 else torch.cat([r.park[4] for r in group])
        s0 = cache.counters()
        try:
            y = self.rt.model.experts.compute(layer, x, idx, w)
        except BaseException as e:          # each sequence of the group fails with it
            for r in group:
                self._resume(r, None, throw=e)
            return
        s1 = cache.counters()
        if len(group) > 1:
            self.last.groups.append(len(group))
        rows = [r.park[2].shape[0] for r in group]
        for k in COUNTED:
            d = s1[k] - s0[k]
            attributed[k] += d
            for r, part in zip(group, split(d, rows)):
                r.seq.cache.share[k] += part
        a = 0
        for r in group:
            n = r.park[2].shape[0]
            self._resume(r, y[a:a + n])
            a += n


    def _run_dense(self, group: list[_Row]) -> None:
        """One decode layer (attention and all up to the experts) for every row of the group at
        once: the layer's weights read once, each row its own KV (native decode_layer_rows)."""
        _, layer, fast0, *_ = group[0].park
        try:
            h = torch.cat([r.park[3] for r in group])
            cos = torch.stack([r.park[5] for r in group]).contiguous()
            sin = torch.stack([r.park[6] for r in group]).contiguous()
            m = fast0.model_args
            x = torch.empty(len(group), m.C, dtype=torch.float32)
            idx = torch.empty(len(group), m.topk, dtype=torch.int64)
            w = torch.empty(len(group), m.topk, dtype=torch.float32)
            native.decode_layer_rows([r.park[2].whole[layer] for r in group], m, h, [r.park[4] for r in group],
                                     cos, sin, x, idx, w)
        except BaseException as e:          # each sequence of the group fails with it
            for r in group:
                self._resume(r, None, throw=e)
            return
        for i, r in enumerate(group):
            r.park[3].copy_(h[i:i + 1])     # the residual stream, updated in place as the one-row call does
            routed = (idx[i:i + 1], w[i:i + 1]) if r.park[2].routes else None
            self._resume(r, (x[i:i + 1], routed))

    def _run_logits(self, group: list[_Row]) -> None:
        """The LM head over every row of the group in one call where that keeps each row's bits."""
        model = self.rt.model
        try:
            rows = [r.park[1] for r in group]
            if self._head_rows and len(rows) > 1:
                y, outs, a = model.logits(torch.cat(rows)), [], 0
                for t in rows:
                    outs.append(y[a:a + t.shape[0]])
                    a += t.shape[0]
            else:
                outs = [model.logits(t) for t in rows]
        except BaseException as e:
            for r in group:
                self._resume(r, None, throw=e)
            return
        for r, y in zip(group, outs):
            self._resume(r, y)


PARKS = ("dense", "experts", "logits")


def _stage(park: tuple) -> tuple:
    """Where a parked sequence is in the step: a layer's attention before its experts, the LM
    head after every layer."""
    kind = park[0]
    return (float("inf"), 2) if kind == "logits" else (park[1], PARKS.index(kind))


def _head_takes_rows(model) -> bool:
    """True where the LM head over several sequences' rows gives each row its own call's bits:
    the shared logits() over GGUF rows the native kernels compute (torch's float GEMMs may sum a
    row differently when it has company)."""
    from mawforge.kernels.cpu import native_rows
    from mawforge.models.base import MoETransformer
    return type(model).logits is MoETransformer.logits and native_rows(model.w.head()) is not None
