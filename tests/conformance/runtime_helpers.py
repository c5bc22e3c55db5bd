"""Opening a runtime on a pack and the few ways the shared tests drive it."""
from __future__ import annotations

import torch

from . import api


def open_rt(pack_dir, budget="100", context: int = 96, **kw) -> api.Runtime:
    """budget: "min" (the plan's smallest cache), a percent as a string, or None (kw decides)."""
    if budget == "min":
        kw["expert_cache_gib"] = api.PackFacts.from_pack(pack_dir).min_cache_bytes / api.GiB
    elif budget is not None:
        kw["expert_cache_percent"] = float(budget)
    return api.Runtime(pack_dir, api.RuntimeOptions(context=context, **kw))


def mtp_rt(pack_dir, budget="100", context: int = 96, **kw) -> api.Runtime:
    """open_rt with prefetch off unless asked: the MTP and rollback checks compare exact
    counterfactuals, whose cache decisions must follow from routing alone (auto prefetch's
    lookahead and on/off windows are live-only)."""
    kw.setdefault("prefetch", "none")
    return open_rt(pack_dir, budget, context, **kw)


def logits(pack_dir, tokens, budget="40", context: int = 96, prefill_chunk: int = 16, **kw) -> torch.Tensor:
    rt = open_rt(pack_dir, budget, context=context, prefill_chunk=prefill_chunk, **kw)
    try:
        return rt.forward(list(tokens), all_logits=True)
    finally:
        rt.close()


def greedy(pack_dir, prompt, n: int, budget="100", **kw) -> tuple[list[int], dict]:
    rt = open_rt(pack_dir, budget, **kw)
    try:
        evs = list(api.generate(rt, list(prompt), api.SamplingParams(max_tokens=n, ignore_eos=True)))
        return [e.token for e in evs], rt.cache.stats()
    finally:
        rt.close()
