"""The speculative-decoding flags of `run` and `serve`, and the speculator they ask for."""
from __future__ import annotations

import argparse

from mawforge.commands.plan import pair_plan_from_args
from mawforge.engine.options import RuntimeOptions
from mawforge.errors import BudgetRejected
from mawforge.plan import PairPlan
from mawforge.speculative.decode import MODES, SpecOptions


def uses_draft_pack(a: argparse.Namespace) -> bool:
    """Whether this command's speculation may load --draft-pack: draft, or auto (which loads it
    unless the model has MTP layers; the plan then keeps room the draft may not use)."""
    return bool(a.draft_pack) and a.speculative in ("draft", "auto")


def pair_plan_or_reject(a: argparse.Namespace, opts: RuntimeOptions) -> PairPlan | None:
    """`run`/`serve` with a draft pack: the static plan of target + draft under the command's
    configuration, checked before loading (the target then loads with reserved_bytes = draft L)."""
    if not uses_draft_pack(a):
        return None
    pair = pair_plan_from_args(a, opts)
    if not pair.feasible:
        raise BudgetRejected(f"plan rejected with the draft model: {pair.reason}")
    return pair


def add_speculative_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculative", choices=MODES, default="off",
                   help="speculative decoding: auto (only while measured tok/s beats plain), off, ngram "
                        "(prompt lookup), draft (--draft-pack), mtp (models with MTP layers)")
    p.add_argument("--draft-k", type=int, default=4, help="tokens drafted per verify step")
    p.add_argument("--draft-pack", default=None, help="a smaller pack with the same tokenizer, for --speculative draft")
    p.add_argument("--draft-cache-percent", type=float, default=100.0, help="the draft pack's expert cache")


def spec_options(a: argparse.Namespace) -> SpecOptions | None:
    """The speculation flags as options for Model.from_options (None: off)."""
    opts = SpecOptions(mode=a.speculative, k=a.draft_k, draft_pack=a.draft_pack,
                       draft_cache_percent=a.draft_cache_percent)
    return None if opts.mode == "off" else opts
