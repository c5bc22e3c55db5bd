"""One telemetry schema for the CLI, the server and the bench (documented in docs/telemetry.md)."""
from __future__ import annotations

import math
import os
import resource
from dataclasses import asdict, dataclass, field

SCHEMA = "mawforge.telemetry/1"


def peak_rss_bytes() -> int:
    """Peak resident set of this process image: VmHWM from /proc/self/status. (ru_maxrss is not
    used: Linux carries it across fork+exec, so a child of a large parent reports the parent's peak.)"""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class StallMeter:
    """Per decode step, how long the compute waited on expert reads and how many tokens the step
    emitted (one, or accepted drafts plus one). A higher hit rate is not always a faster run:
    these say how many tokens paid for a read and how long the typical and the bad waits were."""

    def __init__(self) -> None:
        self.waits: list[float] = []
        self.tokens = self.stalled_tokens = 0

    def record(self, wait_s: float, tokens: int) -> None:
        self.tokens += tokens
        if wait_s > 0.0:
            self.waits.append(wait_s)
            self.stalled_tokens += tokens

    def summary(self) -> tuple[float, float, float]:
        """(share of decode tokens that waited, p50 wait, p95 wait): nearest-rank percentiles
        over the steps that waited; zeros when none did."""
        if not self.waits:
            return 0.0, 0.0, 0.0
        w = sorted(self.waits)
        rank = lambda q: w[max(0, math.ceil(len(w) * q) - 1)]
        return self.stalled_tokens / max(self.tokens, 1), rank(0.5), rank(0.95)


@dataclass
class Telemetry:
    schema: str = SCHEMA
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0              # prompt tokens taken from the prompt cache, not prefilled again
    ttft_s: float = 0.0                 # request start -> first token sampled
    prefill_s: float = 0.0
    decode_s: float = 0.0               # first token -> last token
    decode_tok_s: float = 0.0           # (completion_tokens - 1) / decode_s
    total_s: float = 0.0
    hits: int = 0
    misses: int = 0
    hit_rate: float = 0.0
    evictions: int = 0
    materialized_bytes: int = 0         # logical bytes read from experts.pack on demand
    prefetched_bytes: int = 0
    prefetch_useful_bytes: int = 0
    prefetch_wasted_bytes: int = 0
    demand_load_s: float = 0.0          # wall time the compute waited on demand reads (misses)
    prefetch_stall_s: float = 0.0       # wall time the compute waited on prefetches still in flight
    decode_stall_token_share: float = 0.0   # decode tokens whose step waited on an expert read
    decode_stall_p50_s: float = 0.0     # median wait of the decode steps that waited
    decode_stall_p95_s: float = 0.0     # 95th percentile of those waits
    prefill_read_bytes: int = 0         # expert bytes read from the pack during prefill
    prefill_needed_bytes: int = 0       # bytes of the distinct blocks the prompt routed to
    compute_threads: dict = field(default_factory=dict)   # the thread governor's state (engine/threads.py)
    # prefetch mode; under auto its state and switches (engine/prefetch_auto.py)
    prefetch: dict = field(default_factory=dict)
    expert_cache_bytes: int = 0         # the cache's budget E
    expert_cache_held_bytes: int = 0    # slot bytes actually held
    kv_cache_bytes: int = 0
    resident_common_bytes: int = 0
    embedding_bytes_read: int = 0
    rss_bytes: int = 0
    peak_rss_bytes: int = 0
    budget_bytes: int | None = None
    budget_source: str = ""
    planned_footprint_bytes: int = 0    # F = C + E + K + P + O, plus the drafter's planned bytes
    planned_draft_bytes: int = 0        # a draft model's L (or MTP state) within F
    cache_policy: str = ""
    # decode's miss policy (models/miss_policy.py) and the experts it substituted / skipped
    miss_policy: dict = field(default_factory=lambda: {"mode": "exact", "threshold": None,
                                                       "substituted": 0, "skipped": 0})
    pack_digest: str = ""
    finish_reason: str = ""
    speculative: dict = field(default_factory=lambda: {"mode": "off", "drafted": 0, "accepted": 0,
                                                       "verify_steps": 0, "verify_width": 0.0,
                                                       "extra_materialized_bytes": 0})

    # the prompt cache (engine/prompt_reuse.py): where the reuse came from ("live", "saved",
    # "none"; "off" without a cache) and the store's state after the request
    prompt_cache: dict = field(default_factory=lambda: {"source": "off"})

    def to_dict(self) -> dict:
        return asdict(self)

    def set_prompt_cache(self, reuse, cache) -> None:
        self.cached_tokens = reuse.cached
        self.prompt_cache = {"source": reuse.source if cache is not None else "off",
                             **(cache.report() if cache is not None else {})}

    def set_stalls(self, meter: "StallMeter") -> None:
        self.decode_stall_token_share, self.decode_stall_p50_s, self.decode_stall_p95_s = meter.summary()

    def line(self) -> str:
        g = lambda n: f"{n / 2**30:.3f}GiB" if n >= 2**30 else f"{n / 2**20:.1f}MiB"
        return (f"[telemetry] prompt {self.prompt_tokens} tok ({self.cached_tokens} cached), completion "
                f"{self.completion_tokens} tok | "
                f"TTFT {self.ttft_s:.3f}s | decode {self.decode_tok_s:.2f} tok/s | hits {self.hits} "
                f"misses {self.misses} hit rate {100 * self.hit_rate:.1f}% evictions {self.evictions} | "
                f"read stalls {100 * self.decode_stall_token_share:.0f}% of tokens, p50 "
                f"{1e3 * self.decode_stall_p50_s:.1f}ms p95 {1e3 * self.decode_stall_p95_s:.1f}ms | "
                f"materialized {g(self.materialized_bytes)} | expert cache {g(self.expert_cache_bytes)} "
                f"KV {g(self.kv_cache_bytes)} common {g(self.resident_common_bytes)} | "
                f"peak RSS {g(self.peak_rss_bytes)} (planned F {g(self.planned_footprint_bytes)}"
                + (f", draft {g(self.planned_draft_bytes)} of it)" if self.planned_draft_bytes else ")"))
