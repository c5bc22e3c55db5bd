"""The run configuration: one typed value (RuntimeOptions, its budget a plan.Budget) and the one
function that turns it and a pack's facts into the plan. Every plan of a run is made here, by the
runtime, `serve`, the Python API, `mawforge plan`, `bench` and `tune` alike. Torch-free, so the
commands that only plan never load the framework."""
from __future__ import annotations

from dataclasses import dataclass, replace

from mawforge.errors import FormatError
from mawforge.models.miss_policy import MissPolicy
from mawforge.plan import (PREFILL_WAVE, Budget, PackFacts, PairPlan, Plan, default_budget, draft_footprint,
                           make_plan)


@dataclass(frozen=True)
class RuntimeOptions:
    context: int = 4096
    budget: Budget | None = None       # what L must fit in (None: plan.default_budget, or none at all
    default_budget: bool = True        # when False: no budget given means none, every expert cached
    expert_cache_percent: float | None = None
    expert_cache_gib: float | None = None
    policy: str = "s3fifo"             # measured against lru on full-size traces: cache/policies.py S3FIFO
    prefetch: str | None = "auto"      # "auto" (engine/prefetch_auto.py), "none", or a policy spec
    device: str = "cpu"
    stream_embeddings: bool = False
    kv_dtype: str | None = None
    direct_io: bool = True
    check_digests: bool = True
    io_threads: int = 4
    prefill_chunk: int = 128           # tokens one attention (or delta-net) call takes
    prefill_wave: int = PREFILL_WAVE   # tokens a prompt runs layer by layer (rounded down to whole chunks)
    threads: int | None = None
    thread_governor: bool = True       # decode steps choose the kernels' thread count by measured speed
    lookahead: bool = False            # router lookahead prefetch (engine/runtime.py LOOKAHEAD; on in "auto")
    reserved_bytes: int = 0            # a draft model's L in this process: the target plans in the rest
    extra_overhead_bytes: int = 0      # held beside the runtime by the caller (serve's dashboard): in O
    prompt_cache_gib: float | None = None   # saved prompts (P); 0: off; None: plan.py's auto size
    max_batch: int = 1                 # sequences a batching server steps at once: K counts each one's KV
    miss_policy: str = "exact"         # decode's handling of a missed expert (models/miss_policy.py)

    def __post_init__(self) -> None:
        if self.prefill_chunk < 1:
            raise FormatError(f"prefill chunk must be positive, got {self.prefill_chunk}")
        if self.prefill_wave < 1:
            raise FormatError(f"prefill wave must be positive, got {self.prefill_wave}")
        MissPolicy.parse(self.miss_policy)     # a bad spec fails here, before anything loads
        if self.budget is not None and not isinstance(self.budget, Budget):
            raise TypeError(f"RuntimeOptions.budget takes a plan.Budget, got {type(self.budget).__name__}")


def plan_for_options(facts: PackFacts, opts: RuntimeOptions, framework_bytes: int | None = None) -> Plan:
    """The one plan of a run: the pack's facts under the options' budget (less reserved_bytes,
    a draft model's L), context, cache and prefill settings. framework_bytes: measured in this
    process, or None for the static figure (plan.FRAMEWORK_BYTES)."""
    budget = opts.budget
    if budget is None and opts.default_budget:
        budget = default_budget()
    if budget is not None and opts.reserved_bytes:
        budget = budget.less(opts.reserved_bytes, "the draft's L")
    return make_plan(facts, budget=budget, context=opts.context,
                     expert_cache_percent=opts.expert_cache_percent, expert_cache_gib=opts.expert_cache_gib,
                     stream_embeddings=opts.stream_embeddings, kv_dtype=opts.kv_dtype,
                     prefill_chunk=opts.prefill_chunk, prefill_wave=opts.prefill_wave,
                     framework_bytes=framework_bytes, extra_overhead_bytes=opts.extra_overhead_bytes,
                     prompt_cache_gib=opts.prompt_cache_gib, sequences=opts.max_batch)


def draft_options(target: RuntimeOptions, draft_cache_percent: float) -> RuntimeOptions:
    """How a draft model (speculative decoding) is loaded beside the target: the target's context,
    KV dtype and prefill chunk, its own expert cache percent, no budget and no prompt cache."""
    return RuntimeOptions(context=target.context, expert_cache_percent=draft_cache_percent, default_budget=False,
                          policy=target.policy, device=target.device, kv_dtype=target.kv_dtype,
                          direct_io=target.direct_io, prefill_chunk=target.prefill_chunk, prompt_cache_gib=0.0)


def pair_plan_for_options(facts: PackFacts, draft: PackFacts, opts: RuntimeOptions, draft_cache_percent: float,
                          draft_pack: str = "") -> PairPlan:
    """A target and its draft model against one budget, before either loads: the draft's plan as
    the drafter loads it (draft_options), then the target's against the budget less the draft's L,
    so a cache sized from the budget leaves room for the draft (static figures: no process to
    measure yet)."""
    if opts.budget is None and opts.default_budget:
        opts = replace(opts, budget=default_budget())
    dp = plan_for_options(draft, draft_options(opts, draft_cache_percent))
    tp = plan_for_options(facts, replace(opts, reserved_bytes=dp.L))
    return draft_footprint(tp, dp, None if opts.budget is None else opts.budget.bytes, draft_pack)
