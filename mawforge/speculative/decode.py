"""Speculative decoding on the one generation path, with MoE-aware accounting.

    spec = Speculator(rt, SpecOptions(mode="ngram", k=4))    # once per runtime (loads a draft pack)
    for ev in generate(rt, ids, params, speculative=spec):   # the same generator as plain decoding
        ...
    ev.telemetry.speculative                                 # drafted, accepted, widths, expert union, extra bytes

Each step: the drafter proposes k tokens; the target runs [last] + drafts in ONE batched
forward through the expert cache (all logits), accepts a prefix by exact rule (greedy: match the
argmax; sampling: accept with min(1, p/q), else resample from norm(max(0, p - q))), then rolls
its KV back over the rejected positions (recurrent delta-net state included: the verify forward
runs under KVCache.mark). The output distribution is the plain sampler's.

Legend: W verify width (1 + drafts), V vocabulary size.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from mawforge.speculative.drafters import Drafter, has_mtp, make_drafter
from mawforge.engine.generate import PlainDecoder
from mawforge.engine.runtime import Runtime
from mawforge.engine.sampling import Sampler, SamplingParams
from mawforge.speculative.accounting import AutoController, Counterfactual, RouteTap, counters, delta
from mawforge.errors import BudgetRejected, RequestError
from mawforge.plan import draft_footprint

MODES = ("auto", "off", "ngram", "draft", "mtp")
clock = time.perf_counter     # the engine-time clock auto compares modes with (tests replace it)
MAX_STEP_RECORDS = 256      # per-step rows kept in telemetry; totals always cover every step


@dataclass(frozen=True)
class SpecOptions:
    mode: str = "off"
    k: int = 4                        # draft horizon: tokens proposed per verify step
    draft_pack: str | None = None
    draft_cache_percent: float = 100.0
    ngram_max: int = 3
    ngram_min: int = 1
    window: int = 8                   # auto: emitted tokens per measurement window
    probe_every: int = 4              # auto: re-probe the losing mode every this many windows

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise RequestError(f"speculative mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if not 1 <= self.k <= 32:
            raise RequestError(f"draft horizon k must be in [1, 32], got {self.k}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise RequestError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")
        if self.window < 1 or self.probe_every < 1:
            raise RequestError("auto window and probe interval must be positive")
        if not 0 < self.draft_cache_percent <= 100:
            raise RequestError(f"draft cache percent must be in (0, 100], got {self.draft_cache_percent}")


def drafter_for(mode: str, rt: Runtime, opts: SpecOptions) -> str:
    """The drafter a mode uses; auto picks MTP heads if the model has them, else a draft pack
    if one was given, else prompt lookup."""
    if mode != "auto":
        return mode
    if has_mtp(rt) and hasattr(rt.model, "mtp_propose"):
        return "mtp"
    return "draft" if opts.draft_pack else "ngram"


def accept_drafts(sampler: Sampler, logits: torch.Tensor, drafts: list[int],
                  q: list[torch.Tensor] | None) -> tuple[int, int]:
    """logits [W, V] for [last] + drafts. Returns (accepted drafts, the token that follows them).
    q: the draft distributions ([V] each), or None for deterministic proposals (point masses).
    The sampler's processors advance through each accepted draft while the next is checked (its
    mask or penalty depends on them) and are rolled back before returning: the generator
    accepts every emitted token itself."""
    n = 0
    try:
        for i, d in enumerate(drafts):
            if sampler.greedy:
                t = sampler.sample(logits[i])
                if t != d:
                    return i, t
            else:
                p = sampler.probs(logits[i])                                    # [V]
                qd = 1.0 if q is None else float(q[i][d])
                if sampler.uniform() >= min(1.0, float(p[d]) / qd):
                    resid = p.clone()
                    if q is None:
                        resid[d] = 0.0
                    else:
                        resid = torch.clamp(p - q[i], min=0.0)
                    s = float(resid.sum())
                    return i, sampler.draw(resid / s if s > 0 else p)
            sampler.accept(d)
            n += 1
        return len(drafts), sampler.sample(logits[len(drafts)])
    finally:
        sampler.rollback(n)


class SpecDecoder(PlainDecoder):
    """One request's speculative steps and their accounting. Created after prefill."""

    def __init__(self, rt: Runtime, sampler: Sampler, drafter: Drafter, opts: SpecOptions, mode: str) -> None:
        super().__init__(rt, sampler)
        self.drafter, self.opts, self.mode = drafter, opts, mode
        self.auto = AutoController(opts.window, opts.probe_every) if mode == "auto" else None
        self.tap = RouteTap()
        rt.cache.observers.append(self.tap)
        self.shadow = Counterfactual(rt.cache)
        self.pending: tuple | None = None       # routing, kept rows, live delta, step record (or None)
        self.steps: list[dict] = []
        self.tot = dict(drafted=0, accepted=0, verify_steps=0, verify_tokens=0, plain_steps=0,
                        union_sum=0, layer_steps=0, single_sum=0, single_layer_steps=0)
        self.live = dict.fromkeys(("hits", "misses", "evictions", "materialized_bytes", "prefetch_issued_bytes"), 0)
        self.plain = dict(self.live)
        self.draft_s = 0.0

    def step(self, context: list[int], room: int) -> list[int]:
        self._settle(None)
        rt = self.rt
        t0 = clock()
        speculate = self.auto is None or self.auto.mode() == "spec"
        k = min(self.opts.k, room - 1)
        drafts = self.drafter.propose(context, k)[:k] if speculate and k > 0 else []
        t1 = clock()
        self.tap.clear()
        before = counters(rt.cache.core)
        if drafts:
            rt.kv.mark()
            try:
                logits = rt.forward([context[-1]] + drafts, all_logits=True, kind="decode")      # [W, V]
                n_acc, nxt = accept_drafts(self.sampler, logits, drafts, self.drafter.probs)
                rt.kv.truncate(rt.kv.pos - len(drafts) + n_acc)
            finally:
                rt.kv.unmark()
            out = drafts[:n_acc] + [nxt]
        else:
            n_acc, out = 0, [self.sampler.sample(rt.forward([context[-1]], kind="decode")[-1])]
        elapsed = clock() - t0
        live = delta(counters(rt.cache.core), before)
        self.draft_s += t1 - t0
        if self.auto is not None:
            self.auto.record("spec" if speculate else "plain", len(out), elapsed)
        rec = self._record(len(drafts), n_acc, self.tap.union_per_layer(), live)
        self.pending = (self.tap.routing(), 1 + n_acc, live, rec)
        return out

    def _record(self, drafted: int, accepted: int, union: list[int], live: dict) -> dict | None:
        t = self.tot
        if drafted:
            t["verify_steps"] += 1
            t["verify_tokens"] += 1 + drafted
            t["union_sum"] += sum(union)
            t["layer_steps"] += len(union)
        else:
            t["plain_steps"] += 1
            t["single_sum"] += sum(union)
            t["single_layer_steps"] += len(union)
        t["drafted"] += drafted
        t["accepted"] += accepted
        if len(self.steps) >= MAX_STEP_RECORDS:
            return None
        self.steps.append({"width": 1 + drafted, "drafted": drafted, "accepted": accepted,
                           "union_experts_per_layer": union,
                           **{k: live[k] for k in ("misses", "evictions", "materialized_bytes")}})
        return self.steps[-1]

    def _settle(self, used: int | None) -> None:
        """Replay the last step's kept positions in the counterfactual; `used` limits them to
        the tokens the request really consumed (a stop string can end it mid-step)."""
        if self.pending is None:
            return
        routing, kept, live, rec = self.pending
        self.pending = None
        n = kept if used is None else min(kept, used)
        plain = self.shadow.run(routing, n)
        for k in self.live:
            self.live[k] += live[k]
            self.plain[k] += plain[k]
        if rec is not None:
            rec["plain_materialized_bytes"] = plain["materialized_bytes"]

    def finish(self, used: int) -> None:
        self._settle(used)

    def report(self) -> dict:
        t, top_k = self.tot, self.rt.cfg.top_k
        union = t["union_sum"] / t["layer_steps"] if t["layer_steps"] else 0.0
        single = t["single_sum"] / t["single_layer_steps"] if t["single_layer_steps"] else float(top_k)
        out = {
            "mode": self.mode, "drafter": self.drafter.name, "k": self.opts.k,
            "drafted": t["drafted"], "accepted": t["accepted"],
            "acceptance_rate": t["accepted"] / t["drafted"] if t["drafted"] else 0.0,
            "verify_steps": t["verify_steps"], "plain_steps": t["plain_steps"],
            "verify_width": t["verify_tokens"] / t["verify_steps"] if t["verify_steps"] else 0.0,
            "union_experts_per_layer": union, "single_token_experts_per_layer": single,
            "union_ratio": union / single if union and single else 0.0,
            "decode_materialized_bytes": self.live["materialized_bytes"],
            "plain_materialized_bytes": self.plain["materialized_bytes"],
            "extra_materialized_bytes": self.live["materialized_bytes"] - self.plain["materialized_bytes"],
            "extra_misses": self.live["misses"] - self.plain["misses"],
            "extra_evictions": self.live["evictions"] - self.plain["evictions"],
            "extra_prefetched_bytes": self.live["prefetch_issued_bytes"] - self.plain["prefetch_issued_bytes"],
            "plain_counterfactual": "replayed" + (" (router lookahead not replayed)" if self.rt.lookahead else ""),
            "draft_s": self.draft_s,
            "rollback_state_bytes": self.rt.kv.rollback_bytes,
            "draft": {**self.drafter.memory(), **self.drafter.counters()},
            "steps": self.steps,
        }
        if self.auto is not None:
            out["auto"] = self.auto.report()
        return out

    def close(self) -> None:
        if self.tap in self.rt.cache.observers:
            self.rt.cache.observers.remove(self.tap)


class Speculator:
    """Per-runtime speculation settings and the drafter they need (a draft pack is loaded once)."""

    def __init__(self, rt: Runtime, opts: SpecOptions, _drafter: Drafter | None = None) -> None:
        self.rt, self.opts = rt, opts
        self.kind = drafter_for(opts.mode, rt, opts)
        off = opts.mode == "off"
        self.drafter = _drafter if _drafter is not None else (None if off else make_drafter(self.kind, rt, opts))
        self._owns = _drafter is None
        if self.drafter is not None:
            check_draft_budget(rt, self.drafter)

    def for_request(self, mode: str | None) -> Speculator | None:
        """A request's `speculative` option: None keeps the server's setting, 'off' disables it,
        'ngram' is always available, other modes need the drafter the server loaded."""
        if mode is None or mode == self.opts.mode:
            return None if self.opts.mode == "off" else self
        if mode == "off":
            return None
        opts = replace(self.opts, mode=mode)
        kind = drafter_for(mode, self.rt, opts)
        if kind == "ngram":
            return Speculator(self.rt, opts)
        if self.drafter is None or self.drafter.name != kind:
            raise RequestError(f"speculative mode {mode!r} needs the {kind} drafter, which this server did not load")
        return Speculator(self.rt, opts, self.drafter)

    def decoder(self, prompt: list[int], params: SamplingParams, sampler: Sampler) -> PlainDecoder:
        if self.drafter is None:
            return PlainDecoder(self.rt, sampler)
        self.drafter.begin(prompt, params)
        return SpecDecoder(self.rt, sampler, self.drafter, self.opts, self.opts.mode)

    def close(self) -> None:
        if self.drafter is not None and self._owns:
            self.drafter.close()


def check_draft_budget(rt: Runtime, drafter: Drafter) -> None:
    """The loaded pair against the whole budget (the target may have planned against the budget
    less the draft's L: RuntimeOptions.reserved_bytes)."""
    draft_rt = getattr(drafter, "rt", None)
    if draft_rt is None:
        return
    pair = draft_footprint(rt.plan, draft_rt.plan, None if rt.opts.budget is None else rt.opts.budget.bytes)
    if not pair.feasible:
        drafter.close()
        raise BudgetRejected(f"plan rejected with the draft model: {pair.reason}")


def summary_line(s: dict) -> str:
    g = lambda n: f"{n / 2**20:.1f}MiB"
    line = (f"[speculative] {s['mode']} ({s.get('drafter', '-')}, k={s.get('k', 0)}) | accepted "
            f"{s['accepted']}/{s['drafted']} | verify steps {s['verify_steps']} width {s['verify_width']:.2f} | "
            f"experts/layer {s.get('union_experts_per_layer', 0):.2f} vs "
            f"{s.get('single_token_experts_per_layer', 0):.2f} single | extra materialized "
            f"{g(s['extra_materialized_bytes'])}, evictions {s.get('extra_evictions', 0):+d}")
    auto = s.get("auto")
    if auto:
        line += f" | auto: spec {auto['spec_windows']} / plain {auto['plain_windows']} windows"
    return line
