"""`mawforge plan`: say before loading whether a configuration fits a memory budget; the budget
flags every command shares, and their plans (the budget model itself is mawforge/plan.py)."""
from __future__ import annotations

import argparse
import json

from mawforge.engine.options import RuntimeOptions, pair_plan_for_options, plan_for_options
from mawforge.errors import BudgetRejected
from mawforge.byte_rules import KV_DTYPES
from mawforge.plan import (FLAG_SOURCE, PREFILL_WAVE, PROMPT_CACHE_CONTEXTS, PROMPT_CACHE_ROOM_SHARE,
                           Budget, PackFacts, PairPlan, Plan)


def add_budget_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--memory-budget-gib", type=float, help="the memory target L must fit in")
    p.add_argument("--context", type=int, default=4096, help="KV cache length in tokens")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--expert-cache-percent", type=float, help="expert cache as %% of all routed expert bytes")
    g.add_argument("--expert-cache-gib", type=float, help="expert cache size in GiB")
    p.add_argument("--stream-embeddings", action="store_true", help="read token-embedding rows from the pack on demand")
    p.add_argument("--kv-dtype", choices=KV_DTYPES,
                   help="KV cache dtype (default: float32 for F32 packs, else float16 as llama.cpp; q8_0: "
                        "ggml's 8-bit blocks, 0.53x float16's bytes, as llama.cpp's --cache-type-k/v q8_0)")
    p.add_argument("--prompt-cache-gib", type=float, default=None,
                   help="bytes of saved prompts whose prefix a later request reuses (0: off; default: auto, "
                        f"{PROMPT_CACHE_CONTEXTS} full contexts, under a budget at most "
                        f"{PROMPT_CACHE_ROOM_SHARE:.0%}% of the expert cache's room; off in `run`)")


def budget_from_args(a: argparse.Namespace) -> Budget | None:
    """--memory-budget-gib as the typed budget (None: not given)."""
    return None if a.memory_budget_gib is None else Budget.from_gib(a.memory_budget_gib, FLAG_SOURCE)


def plan_options(a: argparse.Namespace) -> RuntimeOptions:
    """The budget flags as a run configuration (`run` and `serve` add their runtime flags to it):
    the only place those flags become typed values."""
    return RuntimeOptions(budget=budget_from_args(a), context=a.context, expert_cache_percent=a.expert_cache_percent,
                          expert_cache_gib=a.expert_cache_gib, stream_embeddings=a.stream_embeddings,
                          kv_dtype=a.kv_dtype, prompt_cache_gib=getattr(a, "prompt_cache_gib", 0.0),
                          prefill_chunk=getattr(a, "prefill_chunk", 128),
                          prefill_wave=getattr(a, "prefill_wave", PREFILL_WAVE),
                          max_batch=getattr(a, "max_batch", 1))


def plan_from_args(a: argparse.Namespace) -> Plan:
    return plan_for_options(PackFacts.from_pack(a.pack), plan_options(a))


# ---- a draft model beside the target (speculative decoding) --------------------------------


def pair_plan_from_args(a: argparse.Namespace, opts: RuntimeOptions | None = None) -> PairPlan:
    """For `plan`, `run` and `serve` alike (all take --draft-pack and --draft-cache-percent);
    opts: the command's whole configuration (default: the budget flags')."""
    return pair_plan_for_options(PackFacts.from_pack(a.pack), PackFacts.from_pack(a.draft_pack),
                                 opts if opts is not None else plan_options(a), a.draft_cache_percent,
                                 str(a.draft_pack))


help = "say before loading whether a configuration fits a memory budget"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pack", required=True)
    add_budget_arguments(p)
    p.add_argument("--max-batch", type=int, default=1, help="sequences a batching server holds KV for (serve's)")
    p.add_argument("--draft-pack", default=None, help="a draft model for speculative decoding: plan the pair")
    p.add_argument("--draft-cache-percent", type=float, default=100.0, help="the draft pack's expert cache")
    p.add_argument("--json", action="store_true")


def main(a: argparse.Namespace) -> int:
    from mawforge.pack.inspect import describe, fallback_line
    plan = pair_plan_from_args(a) if a.draft_pack else plan_from_args(a)
    fallback = describe(a.pack)["fallback_tensors"]
    if a.json:
        print(json.dumps({**plan.to_dict(), "fallback_tensors": fallback}, indent=1))
    else:
        print(f"kernels: {fallback_line(fallback)}\n{plan.table()}")    # the decision stays the last line
    return 0 if plan.feasible else BudgetRejected.exit_code
