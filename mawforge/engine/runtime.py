"""Runtime: a pack loaded under a byte budget — resident common tensors, the expert cache,
the KV cache, the model and the tokenizer — behind one `forward` that the generator uses.
Its configuration and plan are engine/options.py's RuntimeOptions and plan_for_options."""
from __future__ import annotations

import time
from pathlib import Path

import torch

from mawforge.cache.expert_cache import ExpertCache
from mawforge.cache.store import ExpertStore
from mawforge.models.kv import KVCache
from mawforge.engine.allocator import bound_allocator
from mawforge.engine.prefetch_auto import AUTO_PREFETCHER, PrefetchGovernor
from mawforge.engine.prompt_cache import PromptStore
from mawforge.engine.prompt_reuse import PromptCache
from mawforge.engine.threads import ThreadGovernor
from mawforge.text.tokenizer import load_tokenizer
from mawforge.engine.weights import CommonWeights
from mawforge.engine.options import RuntimeOptions, plan_for_options
from mawforge.errors import BudgetRejected, Cancelled, FormatError, RequestError
from mawforge.kernels import native
from mawforge.models import model_class
from mawforge.models.miss_policy import MissPolicy
from mawforge.pack.manifest import read_index, read_manifest
from mawforge.plan import PackFacts, Plan, framework_in_process


# Router lookahead (on under --prefetch auto): before layer l's experts, layer l+LOOKAHEAD's
# router is applied to layer l's FFN input and its picks are prefetched (layer 0, and every
# layer of a prefill wave, also asks for the layers between: models/moe.py), so each router
# runs once a token for the lookahead and a read has two layers of compute to arrive in (one
# layer's, about 3 ms at full size, is about one block's
# read). On the full-size synthetic file (Intel Xeon, 2026-12-01/02) the picks two layers ahead
# were right for ranks 1-6 in 98-100% of layers, rank 7 in 92%, rank 8 in 72% (one layer ahead:
# 95% and 78%). Inside 8 GiB, alternating runs of this, one layer ahead, and both (the farther
# without its last two ranks) decoded teacher-forced within this VM's noise of each other
# (3.4-3.8 tok/s) with TTFTs of 9.9-11.6 s for 64 tokens; this one costs one router GEMV a layer
# instead of two, which a greedy request inside 8 GiB, where few reads are left to hide, pays
# for in full.
LOOKAHEAD = 2



def check_tokens(tokens: list[int], kv, vocab: int) -> None:
    """What every forward refuses before any work (Runtime's, and each batch sequence's own KV)."""
    if not tokens:
        raise RequestError("nothing to run: empty token list")
    kv.check_room(len(tokens))
    bad = [t for t in tokens if not 0 <= t < vocab]
    if bad:
        raise RequestError(f"token id {bad[0]} is outside the vocabulary of {vocab}")

class Runtime:
    def __init__(self, pack: str | Path, opts: RuntimeOptions = RuntimeOptions(), recorder=None,
                 prompt_store: PromptStore | None = None, plan: Plan | None = None):
        """prompt_store: a store shared with other runtimes (default: its own of the plan's P bytes).
        plan: plan_for_options' plan of this pack and these options, made by the caller (once)."""
        self.pack, self.opts = Path(pack), opts
        bound_allocator()                 # freed activations go back to the OS (engine/allocator.py)
        if opts.threads:
            torch.set_num_threads(opts.threads)
        self.device = torch.device(opts.device)
        self.manifest, self.index = read_manifest(self.pack), read_index(self.pack)
        self.cfg = self.manifest.config
        self.facts = PackFacts.from_pack(self.pack)
        self.plan = plan if plan is not None else plan_for_options(self.facts, opts, framework_in_process())
        if not self.plan.feasible:
            raise BudgetRejected(f"plan rejected: {self.plan.reason}")
        if opts.stream_embeddings and self.cfg.tie_embeddings:
            raise FormatError("--stream-embeddings needs a separate output head; this model ties it to the embeddings")
        self.tokenizer = load_tokenizer(self.pack, self.manifest.tokenizer)
        self.weights = CommonWeights(self.pack, self.manifest, self.device, opts.stream_embeddings,
                                     opts.check_digests)
        self.store = ExpertStore(self.pack, self.index, direct=opts.direct_io,
                                 check_digests=opts.check_digests, threads=opts.io_threads)
        self.recorder = recorder
        auto = (opts.prefetch or "").strip().lower() == "auto"
        self.prefetch_governor = PrefetchGovernor() if auto else None
        self.prefetch_spec = AUTO_PREFETCHER if auto else opts.prefetch
        self.cache = ExpertCache(self.store, self.index, self.plan.E, self.cfg.top_k, self.device,
                                 opts.policy, self.prefetch_spec, recorder)
        self.kv = KVCache.for_config(self.cfg, opts.context, self.plan.kv_dtype, self.device)
        self.model = model_class(self.cfg.arch)(self.cfg, self.weights, self.cache, self.device)
        # the prompt cache (engine/prompt_reuse.py; generate() prefills through it), None when off
        store = prompt_store if prompt_store is not None else PromptStore(self.plan.P) if self.plan.P else None
        self.prompt_cache = PromptCache(self, store) if store is not None else None
        self.model.experts.miss = MissPolicy.parse(opts.miss_policy)
        self.lookahead = opts.lookahead or auto
        if self.lookahead:
            self.model.experts.ahead = LOOKAHEAD
        # called (tokens done, tokens in all) after each layer of a run longer than one chunk
        # (tokens done: the wave's share of its layers done, in tokens): `mawforge run` draws
        # prefill progress with it on a terminal
        self.on_chunk = None
        # while a prompt runs, generate()'s cancelled(): checked after each layer of a run of
        # more than one token, raising errors.Cancelled (the KV positions are not committed)
        self.interrupt = None
        threads = torch.get_num_threads()
        self.governor = (ThreadGovernor(threads) if opts.thread_governor and threads > 1
                         and self.device.type == "cpu" and native.available() else None)

    def prefetch_report(self) -> dict:
        """The request telemetry's `prefetch` field."""
        if self.prefetch_governor is not None:
            return self.prefetch_governor.report()
        return {"mode": self.prefetch_spec or "none", "lookahead": self.lookahead}

    def reset(self, keep: int = 0) -> None:
        """Start a new sequence (keeping the first `keep` positions: the prompt cache's). The thread
        governor re-measures its other choices in the coming
        windows: a choice made in one request's phase (a read-heavy prompt, say, where the I/O
        takes a core) need not hold in the next. The prefetch governor keeps its choice across
        requests (whether prefetch pays depends on the model, the budget and the disk, not on
        the request) and its periodic probes go on: re-measuring "off" for a window at every
        request cost a third of a 24-token request's tokens. It re-measures both when the
        reads a token change phase (PrefetchGovernor), a request's first window left out."""
        self.kv.truncate(keep)
        if self.governor is not None:
            self.governor.chooser.reprobe()
        if self.prefetch_governor is not None:
            self.prefetch_governor.new_request()

    def forward(self, tokens: list[int], all_logits: bool = False, kind: str | None = None) -> torch.Tensor:
        """Run tokens at the next positions; logits of the last token ([1, V]) or all ([T, V]).

        A prompt runs in waves of up to `prefill_wave` tokens, each one cache step that goes
        layer by layer (models/base.py hidden: attention over `prefill_chunk` queries at a time,
        the experts over the whole wave), so inside a memory limit each layer's routed blocks
        are read once per wave rather than once per chunk."""
        check_tokens(tokens, self.kv, self.cfg.vocab)
        outs = []
        step = self.opts.prefill_chunk
        wave = max(step, self.opts.prefill_wave // step * step)    # whole chunks: the same query chunks
        one = kind == "decode" and len(tokens) == 1
        gov = self.governor if one else None
        pgov = self.prefetch_governor if one else None
        if self.cache.complete():
            # a resident model: prefetch would only probe (and router lookahead cost a router
            # GEMV a layer), so none is issued and the governor has nothing to measure
            pgov = None
            self.cache.driver.enabled = False
        else:
            self.cache.driver.enabled = pgov.before_step() if pgov is not None else True
        # auto prefetch times only steps at the thread governor's settled count, so a thread
        # probe's slow window is not charged to the prefetch state that happened to run beside it
        timed = pgov is not None and (gov is None or gov.settled())
        t_start, read0 = time.perf_counter(), self.store.bytes_read
        if gov is not None:
            threads, waited, t0 = gov.before_step(), self.cache.read_wait_seconds(), time.perf_counter()
        elif self.governor is not None:
            self.governor.release()
        with torch.inference_mode():
            for i in range(0, len(tokens), wave):
                part = tokens[i:i + wave]
                self.cache.begin_step(kind or ("prefill" if len(part) > 1 else "decode"), len(part))
                t = torch.tensor(part, dtype=torch.long, device=self.device)
                logits = self.model.forward(t, self.kv.pos, self.kv, all_logits=all_logits, chunk=step,
                                            on_layer=self._progress(i, len(part), len(tokens), step))
                self.kv.commit(len(part))
                self.cache.end_step()
                outs.append(logits)
        if gov is not None:
            gov.after_step(threads, len(tokens),
                           time.perf_counter() - t0 - (self.cache.read_wait_seconds() - waited))
        if timed:
            pgov.after_step(self.cache.driver.enabled, len(tokens), time.perf_counter() - t_start,
                            self.store.bytes_read - read0)
        return torch.cat(outs) if all_logits else outs[-1]

    def _progress(self, start: int, n: int, total: int, step: int):
        """on_layer for a wave of n tokens from `start`: reports tokens done as the wave's
        share of its layers done (None where nobody listens or the run is one chunk), and stops
        a cancelled prompt at the next layer."""
        stop, report = self.interrupt if n > 1 else None, self.on_chunk if total > step else None
        if stop is None and report is None:
            return None
        layers = self.cfg.n_layers

        def on_layer(layer: int) -> None:
            if stop is not None and stop():
                raise Cancelled("the request was cancelled during its prompt")
            if report is not None:
                report(start + n * (layer + 1) // layers, total)
        return on_layer

    def close(self) -> None:
        if self.governor is not None:
            self.governor.close()
        self.cache.close()
        self.store.close()
        self.weights.close()
