"""The budget model (MawForge paper §IV-D): L(p, n) = C + E(p) + K(n) + P, F = L + O. No torch.

C  resident common bytes: common.bin as loaded (less the embedding table when streamed) plus
   the float32 copies of norms, routers and biases the runtime keeps.
E  expert-cache bytes: p percent of all routed expert bytes (page-rounded slots), or absolute.
K  KV-cache bytes at context n: 2 * layers * kv_heads * head_dim * n * dtype size.
P  prompt-cache bytes: saved prompts' KV rows, recurrent checkpoints and last logits
   (engine/prompt_cache.py), --prompt-cache-gib or the auto rule of prompt_cache_bytes.
O  runtime overhead: the framework's own resident memory (measured in-process when the
   runtime plans; FRAMEWORK_BYTES, calibrated for torch 2.13 CPU + MawForge, for the
   static `mawforge plan`), the largest activation working set of a
   prefill chunk (attention scores over the full context included) and of a prefill wave
   (what spans all its tokens while it runs layer by layer), the logits row, the
   dequantization tiles of the kernels, the native kernels' scratch, and the Python objects
   of every block the cache may hold.
A configuration is REJECTED when L exceeds the budget or when E is below one layer's top-k
working set; rejection is a result (exit code 4 at the CLI), not an error.
A draft model for speculative decoding (`--draft-pack`) is planned beside the target: its own
C + E + K at the same context add to the target's L against the one budget (O is shared).
The budget travels as a Budget (bytes and the flag or argument that gave it), which the plan's
table names.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

from mawforge.byte_rules import KV_DTYPES, is_dense, kv_row_bytes, prompt_entry_bytes, state_bytes
from mawforge.errors import FormatError
from mawforge.pack.manifest import read_index, read_manifest
from mawforge.sysmem import DEFAULT_MARGIN, DEFAULT_MARGIN_MIN, cgroup_limit as _cgroup_limit, mem_available as _mem_available  # noqa: E501

GiB = 1 << 30
RUNTIME_GROWTH_BYTES = 32 << 20   # first-forward growth after imports (32-49 MiB measured)
FRAMEWORK_BYTES = 260 << 20   # RSS after `import torch` and the runtime (229-233 MiB measured) + first-forward slack
DEQUANT_TILE_BYTES = 3 * (1 << 18) * 4
# Python and torch objects of one cached block (its slot, buffer and tensor views): measured
# 4.1-4.7 KiB; counted for every block of the pack, the most the cache can hold
SLOT_OBJECT_BYTES = 6 << 10
# the auto prompt cache: this many saved prompts of a full context each, and under a budget at
# most this share of the room the expert cache would otherwise get
PROMPT_CACHE_CONTEXTS = 2
PROMPT_CACHE_ROOM_SHARE = 0.1
PREFILL_WAVE = 2048               # RuntimeOptions.prefill_wave's default: tokens a prompt runs layer by layer
FLAG_SOURCE = "--memory-budget-gib"    # a budget from the command line
API_SOURCE = "memory_budget_gib="      # a budget from the Python API (mawforge.load, plan_for)


@dataclass(frozen=True)
class Budget:
    """The memory L must fit in, in bytes, and where that figure came from (a flag, an API
    argument, a matrix file; "less the draft's L" when a draft model takes its share first):
    the plan's table prints the source beside the bytes, so a rejection says whose budget it was."""
    bytes: int
    source: str

    @classmethod
    def from_gib(cls, gib: float, source: str) -> "Budget":
        return cls(int(gib * GiB), source)

    def less(self, nbytes: int, what: str) -> "Budget":
        """What is left after `what` (nbytes) takes its share first."""
        return Budget(self.bytes - nbytes, f"{self.source} less {what}")


def default_budget() -> Budget | None:
    """With no budget given: what this process can have (sysmem: its cgroup's limit, or the machine's
    available memory, the smaller) less DEFAULT_MARGIN, named in the plan. None off Linux."""
    avail, limit = _mem_available(), _cgroup_limit()
    if avail is None and limit is None:
        return None
    if limit is not None and (avail is None or limit[0] <= avail):
        found, what = limit[0], f"the {limit[0] / GiB:.2f} GiB limit of cgroup {limit[1]}"
    else:
        found, what = avail, f"the {avail / GiB:.2f} GiB this machine has available"
    margin = max(int(found * DEFAULT_MARGIN), DEFAULT_MARGIN_MIN)
    return Budget(max(0, found - margin), f"default: {what}, less {DEFAULT_MARGIN:.0%}")


@dataclass(frozen=True)
class PackFacts:
    """What the planner needs from a pack, read from manifest.json and experts.index."""
    arch: str
    n_layers: int
    n_experts: int
    top_k: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab: int
    expert_ff: int
    common_file_bytes: int
    embedding_bytes: int
    dense_copy_bytes: int
    slot_bytes: tuple[int, ...]        # per layer, page-rounded block size
    all_dense_f32: bool
    pack_digest: str
    kv_layers: tuple = ()              # config.args.kv_layers: per-layer KV or fixed recurrent state
    dense_ff: int = 0                  # widest resident FFN (dense layers, shared experts), 0: none

    @property
    def expert_bytes(self) -> int:
        return sum(s * self.n_experts for s in self.slot_bytes)

    @property
    def min_cache_bytes(self) -> int:
        return max(self.slot_bytes) * self.top_k

    @classmethod
    def from_pack(cls, pack: str | Path) -> "PackFacts":
        man, index = read_manifest(Path(pack)), read_index(Path(pack))
        c = man.config
        dense = 0
        for r in man.common:
            if is_dense(r.name):
                n = 1
                for s in r.shape:
                    n *= s
                dense += 4 * n
        all_f32 = all(t.codec == "f32" for t in man.common) and all(
            t.codec == "f32" for lb in index.layers for t in lb.tensors)
        emb = man.common_record("token_embd.weight")
        dense_ff = max((r.shape[-1] for r in man.common if ".ffn_down" in r.name and len(r.shape) == 2), default=0)
        return cls(c.arch, c.n_layers, c.n_experts, c.top_k, c.hidden, c.n_heads, c.n_kv_heads,
                   c.head_dim, c.vocab, c.expert_ff, int(man.byte_totals["common_file"]),
                   emb.nbytes if emb else 0, dense,
                   tuple(lb.slot_nbytes for lb in index.layers), all_f32, man.pack_digest,
                   tuple(c.args.kv_layers), dense_ff)


def kv_dtype_for(f: PackFacts, kv_dtype: str | None) -> str:
    return kv_dtype or ("float32" if f.all_dense_f32 else "float16")   # float16: llama.cpp's default


def kv_bytes(f: PackFacts, context: int, kv_dtype: str) -> int:
    """KV of attention layers at this context plus the fixed float32 state of recurrent layers."""
    if not f.kv_layers:
        return 2 * f.n_layers * f.n_kv_heads * context * kv_row_bytes(f.head_dim, kv_dtype)
    return fixed_state_bytes(f) + state_bytes(f.kv_layers, context, kv_dtype, grows=True)


def fixed_state_bytes(f: PackFacts) -> int:
    return state_bytes(f.kv_layers, 0, "float32", grows=False)


def prompt_cache_bytes(f: PackFacts, context: int, kv_dtype: str) -> int:
    """The auto prompt-cache size: PROMPT_CACHE_CONTEXTS saved prompts of a full context (two
    checkpoints each for a recurrent model)."""
    layout = f.kv_layers or [{"kind": "kv", "kv_heads": f.n_kv_heads, "head_dim": f.head_dim}] * f.n_layers
    checkpoints = 2 if any(s["kind"] == "recurrent" for s in layout) else 0
    return PROMPT_CACHE_CONTEXTS * prompt_entry_bytes(layout, context, kv_dtype, checkpoints, f.vocab)


def framework_in_process() -> int:
    """The framework term measured in this process (when torch and the runtime are already
    imported): its RSS now, shared-library pages included, plus what the first forward
    adds (thread pools, allocator arenas, tokenizer). Resident library pages vary with the
    page cache (RssFile measured 102 MB in one venv and 190 MB in a fresh one, same
    packages), so a process that can measure itself does."""
    try:
        with open("/proc/self/statm") as fh:
            import os
            rss = int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return FRAMEWORK_BYTES
    return max(rss, 0) + RUNTIME_GROWTH_BYTES


def _q8_row_bytes(k: int) -> int:
    """Scratch for one row of k activations quantized by the native kernels (int8 values,
    float scales per 32, int16 sums per 16, padding; kquant_gemm.c's qrow_bytes)."""
    return k + k // 32 * 4 + k // 16 * 2 + 64


def native_scratch_bytes(f: PackFacts, t: int) -> int:
    """The native kernels' scratch for a chunk of t tokens (kept by the calling thread): a
    matmul's quantized x, or a layer's fused experts: x quantized (twice at most), h and its
    quantized copy for each of the t * top_k (expert, token) pairs."""
    widest = max(f.hidden, f.n_heads * f.head_dim, f.expert_ff, f.dense_ff)
    pairs = t * f.top_k
    moe = 2 * t * _q8_row_bytes(f.hidden) + pairs * (4 * f.expert_ff + _q8_row_bytes(f.expert_ff))
    return max(t * _q8_row_bytes(widest), moe)


# models/base.py ATTN_SCORES_BYTES and decode_step.c's ATT_BLOCK / ATT_TILE (plan.py imports no torch)
ATTN_SCORES_BYTES = 64 << 20
ATT_BLOCK, ATT_TILE = 4, 32


def _up16(n: int) -> int:
    return (n + 15) // 16 * 16


def attention_bytes(f: PackFacts, t: int, context: int) -> int:
    """The attention working set of a chunk of t queries over the whole context, by the larger of
    its two paths: the native one (decode_step.c attend_rows: per thread, ATT_BLOCK tokens' rows
    of q, their scores over the context and a tile of converted cache rows; as many threads as
    the machine has cores; attend_one: one token's per kv group) and the torch one
    (models/base.attend, for sliding windows or where no compiler is found: float32 scores and
    probabilities of at most ATTN_SCORES_BYTES, or of one query row, and float32 copies of one
    layer's keys and values)."""
    hg = f.n_heads // max(1, f.n_kv_heads)

    def per(b: int) -> int:     # decode_step.c attend_need: each part rounded up to 16 floats
        return 4 * (_up16(b * hg * f.head_dim) + b * hg * _up16(context) + _up16(ATT_TILE * f.head_dim))
    # attend_rows: one block's scratch per thread; attend_one (a decode step): one per kv group
    native = max((os.cpu_count() or 1) * per(ATT_BLOCK), max(1, f.n_kv_heads) * per(1))
    scores = min(8 * f.n_heads * t * context, max(ATTN_SCORES_BYTES, 8 * f.n_heads * context))
    return max(native, scores + 2 * f.n_kv_heads * context * f.head_dim * 4)


def wave_tokens(context: int, prefill_chunk: int, prefill_wave: int) -> int:
    """Tokens of the longest prefill wave (engine/runtime.py forward): whole chunks, at most the context."""
    t = min(prefill_chunk, context)
    return max(t, min(prefill_wave // prefill_chunk * prefill_chunk, context))


def wave_bytes(f: PackFacts, w: int) -> int:
    """Activations that span a whole wave of w tokens while it goes layer by layer: the residual
    stream and its copies (the mixer's output, the FFN input, the experts' sum, the next layer's
    stream: 6 rows of hidden floats), one expert's or a dense FFN's SwiGLU on as many as all w
    tokens (3 rows of its width) and the MoE block's routing masks (models/moe.py: [experts, w,
    top_k] bool and float)."""
    return w * (4 * (6 * f.hidden + 3 * max(f.expert_ff, f.dense_ff)) + 5 * f.n_experts * f.top_k)


def overhead_bytes(f: PackFacts, context: int, prefill_chunk: int, framework: int | None = None,
                   prefill_wave: int = PREFILL_WAVE) -> int:
    t = min(prefill_chunk, context)
    w = wave_tokens(context, prefill_chunk, prefill_wave)
    scores = attention_bytes(f, t, context)
    acts = t * 4 * (6 * f.hidden + 3 * f.n_heads * f.head_dim + 3 * f.expert_ff * f.top_k)   # one chunk's
    logits = 2 * f.vocab * 4
    slots = len(f.slot_bytes) * f.n_experts * SLOT_OBJECT_BYTES
    return ((FRAMEWORK_BYTES if framework is None else framework) + scores + acts + wave_bytes(f, w) + logits
            + DEQUANT_TILE_BYTES + native_scratch_bytes(f, w) + slots)


@dataclass(frozen=True)
class Plan:
    feasible: bool
    reason: str
    budget_bytes: int | None
    budget_source: str
    context: int
    cache_source: str
    C: int
    E: int
    K: int
    O: int
    L: int
    F: int
    expert_bytes_total: int
    cache_percent: float
    min_cache_bytes: int
    kv_dtype: str
    max_cache_percent: float | None = None
    max_context: int | None = None
    pack_digest: str = ""
    P: int = 0
    prompt_cache_source: str = "off"
    sequences: int = 1              # KV slots: a batching server's --max-batch (K counts each)

    def to_dict(self) -> dict:
        return asdict(self)

    def table(self) -> str:
        g = lambda n: f"{n / GiB:9.4f} GiB  ({n:,} B)"
        rows = [("C  resident common", g(self.C)),
                ("E  expert cache", g(self.E) + f"  {self.cache_percent:.1f}% [{self.cache_source}]"),
                ("K  KV cache", g(self.K) + f"  context {self.context}, {self.kv_dtype}"
                 + (f", {self.sequences} sequences" if self.sequences > 1 else "")),
                ("P  prompt cache", g(self.P) + f"  [{self.prompt_cache_source}]"),
                ("L  = C + E + K + P", g(self.L)), ("O  runtime overhead", g(self.O)), ("F  = L + O", g(self.F)),
                ("budget", g(self.budget_bytes) + f"  [{self.budget_source}]" if self.budget_bytes is not None
                 else "none given"),
                ("min expert cache", g(self.min_cache_bytes) + "  (one layer's top-k blocks)"),
                ("largest feasible cache",
                 f"{self.max_cache_percent:.1f}%" if self.max_cache_percent is not None else "n/a"),
                ("longest feasible context", str(self.max_context) if self.max_context is not None else "n/a"),
                ("decision",
                 ("FEASIBLE" if self.feasible else "REJECTED") + (f": {self.reason}" if self.reason else ""))]
        w = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def make_plan(f: PackFacts, *, budget: Budget | None = None, context: int = 4096,
              expert_cache_percent: float | None = None, expert_cache_gib: float | None = None,
              stream_embeddings: bool = False, kv_dtype: str | None = None, prefill_chunk: int = 128,
              framework_bytes: int | None = None, extra_overhead_bytes: int = 0,
              prompt_cache_gib: float | None = 0.0, prefill_wave: int = PREFILL_WAVE, sequences: int = 1) -> Plan:
    """budget: None plans without one (the expert cache then defaults to all of it).
    extra_overhead_bytes: memory the caller's own features hold beside the runtime (the
    serve dashboard's kept route traces), counted in O. prompt_cache_gib: P in GiB (0: off),
    None: the auto rule (prompt_cache_bytes; under a budget at most PROMPT_CACHE_ROOM_SHARE of
    the expert cache's room, or only the budget's slack when the expert cache is given).
    sequences: KV caches of the whole context held at once (a batching server's --max-batch)."""
    if context < 1:
        raise FormatError(f"context must be positive, got {context}")
    if sequences < 1:
        raise FormatError(f"--max-batch must be at least 1, got {sequences}")
    if expert_cache_percent is not None and expert_cache_gib is not None:
        raise FormatError("give --expert-cache-percent or --expert-cache-gib, not both")
    if expert_cache_percent is not None and not 0 < expert_cache_percent <= 100:
        raise FormatError(f"--expert-cache-percent must be in (0, 100], got {expert_cache_percent}")
    if prompt_cache_gib is not None and prompt_cache_gib < 0:
        raise FormatError(f"--prompt-cache-gib must be 0 (off) or positive, got {prompt_cache_gib}")
    kvd = kv_dtype_for(f, kv_dtype)
    if kvd not in KV_DTYPES:
        raise FormatError(f"unknown KV cache dtype {kvd!r}; choose from {', '.join(KV_DTYPES)}")
    C = f.common_file_bytes - (f.embedding_bytes if stream_embeddings else 0) + f.dense_copy_bytes
    K = sequences * kv_bytes(f, context, kvd)
    O = overhead_bytes(f, context, prefill_chunk, framework_bytes, prefill_wave) + extra_overhead_bytes
    source = budget.source if budget is not None else "none"
    budget = budget.bytes if budget is not None else None
    total = f.expert_bytes
    if expert_cache_gib is not None:
        E, src = int(expert_cache_gib * GiB), "--expert-cache-gib"
    elif expert_cache_percent is not None:
        E, src = int(total * expert_cache_percent / 100), "--expert-cache-percent"
    else:
        E, src = None, ("largest cache that fits F in the budget" if budget is not None
                        else "default: 100% (no budget given)")
    if prompt_cache_gib is not None:
        P, psrc = int(prompt_cache_gib * GiB), "--prompt-cache-gib" if prompt_cache_gib else "off"
    else:
        P, psrc = prompt_cache_bytes(f, context, kvd), f"auto: {PROMPT_CACHE_CONTEXTS} full contexts"
        if budget is not None:
            room = budget - C - K - O - (E if E is not None else 0)
            cap = int(room * PROMPT_CACHE_ROOM_SHARE) if E is None else room
            if cap < P:
                P, psrc = max(0, cap), "auto, capped by the budget" + (" (its slack)" if E is not None else "")
    if E is None:
        E = max(0, min(total, budget - C - K - P - O)) if budget is not None else total
    E = min(E, total)
    L = C + E + K + P
    reason = ""
    if E < f.min_cache_bytes:
        reason = (f"expert cache {E / GiB:.4f} GiB is below one layer's top-{f.top_k} working set "
                  f"({f.min_cache_bytes / GiB:.4f} GiB)")
    elif budget is not None and L > budget:
        reason = f"L = C + E + K + P = {L / GiB:.4f} GiB exceeds the budget of {budget / GiB:.4f} GiB"
    max_pct = max_ctx = None
    if budget is not None:
        room = budget - C - K - P
        max_pct = max(0.0, min(100.0, 100.0 * room / total)) if room >= f.min_cache_bytes else 0.0
        fixed = fixed_state_bytes(f) if f.kv_layers else 0
        per_pos = kv_bytes(f, 1, kvd) - fixed
        max_ctx = max(0, (budget - C - E - P - sequences * fixed) // (sequences * per_pos))
    return Plan(not reason, reason, budget, source, context, src,
                C, E, K, O, L, L + O, total, 100.0 * E / total, f.min_cache_bytes, kvd, max_pct, max_ctx,
                f.pack_digest, P, psrc, sequences)


@dataclass(frozen=True)
class PairPlan:
    """A target and its draft model in one process: their L add up against one budget, and the
    runtime overhead O is the target's alone (one process, one forward at a time)."""
    target: Plan
    draft: Plan
    budget_bytes: int | None
    L: int
    F: int
    feasible: bool
    reason: str
    draft_pack: str = ""

    def to_dict(self) -> dict:
        return asdict(self)

    def table(self) -> str:
        g = lambda n: f"{n / GiB:9.4f} GiB  ({n:,} B)"
        d = self.draft
        rows = [("draft pack", self.draft_pack or "-"), ("draft C  resident common", g(d.C)),
                ("draft E  expert cache", g(d.E) + f"  {d.cache_percent:.1f}%"),
                ("draft K  KV cache", g(d.K) + f"  context {d.context}, {d.kv_dtype}"),
                ("draft L  = C + E + K", g(d.L)), ("L  target L + draft L", g(self.L)),
                ("F  = L + O (O shared)", g(self.F)),
                ("budget", g(self.budget_bytes) if self.budget_bytes is not None else "none given"),
                ("decision",
                 ("FEASIBLE" if self.feasible else "REJECTED") + (f": {self.reason}" if self.reason else ""))]
        w = max(len(k) for k, _ in rows)
        return self.target.table() + "\n\n" + "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def draft_footprint(target: Plan, draft: Plan, budget_bytes: int | None = None, draft_pack: str = "") -> PairPlan:
    """Target and draft against one budget (default: the target plan's own budget)."""
    budget = target.budget_bytes if budget_bytes is None else budget_bytes
    L = target.L + draft.L
    reason = ""
    if budget is not None and L > budget:
        reason = (f"target L {target.L / GiB:.4f} GiB + draft L {draft.L / GiB:.4f} GiB = {L / GiB:.4f} GiB "
                  f"exceeds the budget of {budget / GiB:.4f} GiB")
    elif not target.feasible:
        reason = f"target: {target.reason}"
    elif not draft.feasible:
        reason = f"draft: {draft.reason}"
    return PairPlan(target, draft, budget, L, L + target.O, not reason, reason, draft_pack)
