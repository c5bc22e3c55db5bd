"""Drafters for speculative decoding, behind one interface and a registry:

    d = make_drafter("ngram" | "draft" | "mtp", target_rt, options)
    d.begin(prompt, params)                 # once per request
    drafts = d.propose(context_tokens, k)   # up to k proposed continuations of the context
    d.probs                                 # their draft distributions q, or None (point masses)

The context passed to `propose` is every committed token: the prompt, the tokens emitted so far
and the one just sampled (not yet run by the target). A model drafter keeps its own KV cache and
rolls it back to the longest prefix it shares with the context, so rejected drafts cost nothing
to forget (recurrent layers roll back through KVCache.mark). Legend: V vocabulary size.
"""
from __future__ import annotations

from typing import ClassVar

import torch

from mawforge.engine.options import draft_options
from mawforge.engine.runtime import Runtime
from mawforge.engine.sampling import Sampler, SamplingParams
from mawforge.errors import BudgetRejected, FormatError, UnsupportedError


class Drafter:
    """Base class and registry: subclasses declare `class X(Drafter, name="x")`."""

    name: ClassVar[str] = ""
    registry: ClassVar[dict[str, type["Drafter"]]] = {}

    def __init_subclass__(cls, name: str = "", **kw) -> None:
        super().__init_subclass__(**kw)
        if name:
            cls.name = name
            Drafter.registry[name] = cls

    def __init__(self, target: Runtime, options) -> None:
        self.target, self.options = target, options
        self.probs: list[torch.Tensor] | None = None     # q of the last proposal, each [V]

    def begin(self, prompt: list[int], params: SamplingParams) -> None:
        """Start a request; forget anything learned from the previous one."""

    def propose(self, context: list[int], k: int) -> list[int]:
        raise NotImplementedError

    def memory(self) -> dict:
        """Bytes the drafter holds beyond the target's own plan (0 for lookup drafters)."""
        return {"resident_common_bytes": 0, "expert_cache_bytes": 0, "kv_cache_bytes": 0, "planned_bytes": 0}

    def counters(self) -> dict:
        return {}

    def close(self) -> None:
        pass


def make_drafter(kind: str, target: Runtime, options) -> Drafter:
    cls = Drafter.registry.get(kind)
    if cls is None:
        raise UnsupportedError(f"unknown drafter {kind!r}; choose from {', '.join(sorted(Drafter.registry))}")
    return cls(target, options)


class NgramDrafter(Drafter, name="ngram"):
    """Prompt lookup: find the latest earlier occurrence of the context's last n tokens
    (longest n first) and propose what followed it. No model, no memory beyond an index."""

    def __init__(self, target: Runtime, options) -> None:
        super().__init__(target, options)
        self.n_max, self.n_min = options.ngram_max, options.ngram_min
        self.begin([], SamplingParams())

    def begin(self, prompt: list[int], params: SamplingParams) -> None:
        self.seen: list[int] = []
        self.index: dict[tuple[int, ...], int] = {}     # n-gram -> where its latest continuation starts

    def _sync(self, context: list[int]) -> None:
        """Index every n-gram that ends before the context's last token (the suffix itself is
        the query, so it is indexed only once a later token follows it)."""
        if context[:len(self.seen)] != self.seen:
            self.begin([], SamplingParams())
        for end in range(max(len(self.seen) - 1, 0), len(context) - 1):
            for n in range(self.n_min, self.n_max + 1):
                if end + 1 >= n:
                    self.index[tuple(context[end + 1 - n:end + 1])] = end + 1
        self.seen = list(context)

    def propose(self, context: list[int], k: int) -> list[int]:
        self.probs = None
        if k < 1 or not context:
            return []
        self._sync(context)
        for n in range(min(self.n_max, len(context)), self.n_min - 1, -1):
            start = self.index.get(tuple(context[-n:]))
            if start is not None:
                return context[start:start + k]
        return []


class DraftModelDrafter(Drafter, name="draft"):
    """A second, smaller pack that shares the target's tokenizer, as its own Runtime (own
    expert cache and KV). Drafts are sampled from its distribution q with the request's
    sampling parameters, so the target can verify them by rejection sampling."""

    def __init__(self, target: Runtime, options) -> None:
        super().__init__(target, options)
        if not options.draft_pack:
            raise FormatError("--speculative draft needs --draft-pack (a smaller pack with the same tokenizer)")
        self.rt = Runtime(options.draft_pack, draft_options(target.opts, options.draft_cache_percent))
        mine = self.rt.tokenizer.tok.get_vocab(with_added_tokens=True)
        theirs = target.tokenizer.tok.get_vocab(with_added_tokens=True)
        if mine != theirs:
            self.rt.close()
            raise FormatError(f"draft pack {options.draft_pack} does not share the target's tokenizer")
        self.tokens: list[int] = []          # what the draft KV holds
        self.sampler = Sampler(SamplingParams())
        self.stats_at_begin = self.rt.cache.stats()

    def begin(self, prompt: list[int], params: SamplingParams) -> None:
        seed = None if params.seed is None else params.seed + 0x5EED   # its own stream, still reproducible
        self.sampler = Sampler(SamplingParams(temperature=params.temperature, top_k=params.top_k,
                                              top_p=params.top_p, min_p=params.min_p, seed=seed))
        self.stats_at_begin = self.rt.cache.stats()

    def _q(self, logits: torch.Tensor) -> torch.Tensor:
        """q over the target's vocabulary (padded embedding rows differ between packs)."""
        q = self.sampler.probs(logits)
        V = self.target.cfg.vocab
        if q.numel() != V:
            q = torch.nn.functional.pad(q, (0, max(0, V - q.numel())))[:V]
            q = q / q.sum()
        return q

    def propose(self, context: list[int], k: int) -> list[int]:
        self.probs = None
        if k < 1 or not context:
            return []
        common = 0
        for a, b in zip(self.tokens, context):
            if a != b:
                break
            common += 1
        common = min(common, len(context) - 1)       # the last token is re-run for its logits
        if not self.rt.kv.can_truncate(common):      # recurrent state: only back to the last mark
            common = 0
        self.rt.kv.truncate(common)
        self.rt.kv.mark()                            # the next proposal may roll back into this one
        logits = self.rt.forward(context[common:])[-1]
        drafts, qs = [], []
        for i in range(k):
            q = self._q(logits)
            d = int(torch.argmax(q)) if self.sampler.greedy else self.sampler.draw(q)
            drafts.append(d)
            qs.append(q)
            if i < k - 1:
                logits = self.rt.forward([d], kind="decode")[-1]
        self.tokens = list(context) + drafts[:-1]
        self.probs = qs
        return drafts

    def memory(self) -> dict:
        p = self.rt.plan
        return {"pack": str(self.rt.pack), "resident_common_bytes": self.rt.weights.resident_bytes,
                "expert_cache_bytes": p.E, "kv_cache_bytes": self.rt.kv.nbytes, "planned_bytes": p.L}

    def counters(self) -> dict:
        s, b = self.rt.cache.stats(), self.stats_at_begin
        return {k: s[k] - b[k] for k in ("hits", "misses", "evictions", "materialized_bytes")}

    def close(self) -> None:
        self.rt.close()


def has_mtp(rt: Runtime) -> bool:
    return bool(getattr(rt.model, "has_mtp", False))


class MtpDrafter(Drafter, name="mtp"):
    """Multi-token-prediction (nextn) layers of the target itself (Qwen3.5/3.6-MoE, DeepSeek-V3;
    models/mtp.py). The model class provides `has_mtp`, `enable_mtp(context, dtype)` and
    `mtp_propose(context, k, sampler) -> (drafts, q_list | None)`, which reads the hidden states
    the target's forwards kept and keeps its own MTP KV in step with the accepted tokens. The
    MTP layer's weights are common tensors already counted in C; the extra is its KV cache and
    the target's hidden states it has not consumed yet (at most context x hidden float32: a
    prompt's, until the first proposal). Both count against the budget here."""

    def __init__(self, target: Runtime, options) -> None:
        super().__init__(target, options)
        arch, model = target.cfg.arch, target.model
        if not has_mtp(target):
            raise UnsupportedError(f"this model ({arch}) has no MTP layers; use --speculative ngram or draft")
        if not hasattr(model, "mtp_propose"):
            raise UnsupportedError(f"this model ({arch}) has MTP layers, but MTP drafting is not wired for it yet; "
                                   f"use --speculative ngram or draft")
        self.state = model.enable_mtp(target.opts.context, target.plan.kv_dtype)
        self.hidden_bytes = target.opts.context * target.cfg.hidden * 4
        p, extra = target.plan, self.state.kv.nbytes + self.hidden_bytes
        if p.budget_bytes is not None and p.L + extra > p.budget_bytes:
            self.close()
            raise BudgetRejected(f"plan rejected with MTP drafting: target L + {extra / 2**30:.4f} GiB (the MTP "
                                 f"layer's KV cache and kept hidden states) exceeds the budget of "
                                 f"{p.budget_bytes / 2**30:.4f} GiB")
        self.sampler = Sampler(SamplingParams())
        self.proposals = 0

    def begin(self, prompt: list[int], params: SamplingParams) -> None:
        seed = None if params.seed is None else params.seed + 0x5EED   # its own stream, still reproducible
        self.sampler = Sampler(SamplingParams(temperature=params.temperature, top_k=params.top_k,
                                              top_p=params.top_p, min_p=params.min_p, seed=seed))
        self.proposals = 0

    def propose(self, context: list[int], k: int) -> list[int]:
        self.probs = None
        if k < 1 or not context:
            return []
        drafts, self.probs = self.target.model.mtp_propose(context, k, self.sampler)
        self.proposals += 1
        return list(drafts)[:k]

    def memory(self) -> dict:
        kv = self.state.kv.nbytes
        return {"resident_common_bytes": 0, "expert_cache_bytes": 0, "kv_cache_bytes": kv,
                "hidden_state_bytes": self.hidden_bytes, "planned_bytes": kv + self.hidden_bytes}

    def counters(self) -> dict:
        return {"mtp_proposals": self.proposals}

    def close(self) -> None:
        if self.target.model.mtp is self.state:
            self.target.model.disable_mtp()
