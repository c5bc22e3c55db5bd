"""`GET /metrics` through prometheus-client: the exposition format, content negotiation
(Prometheus text 0.0.4 by default, OpenMetrics when the scraper asks) and histograms come from
the library everyone scrapes with, instead of hand-written text.

The names and labels are the ones the hand-written exporter had (docs/telemetry.md): counters
are read from the Ledger at scrape time (one source of truth with the telemetry log), gauges
from the server's state; histograms of per-request TTFT, decode tok/s and read stalls are
observed as each generation finishes.
"""
from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import choose_encoder

PREFIX = "mawforge_"
# buckets: TTFT and stalls span milliseconds (cache hits) to minutes (a cold 30 GB model)
SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TOK_S_BUCKETS = (0.5, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class _LedgerCollector:
    """Counters of the Ledger and the server's gauges, read under the ledger's lock at scrape."""

    def __init__(self, ledger, gauges: Callable[[], dict[str, tuple[float, str]]]):
        self.ledger, self.gauges = ledger, gauges

    def collect(self):
        led = self.ledger
        with led.lock:
            requests = sorted(led.requests.items())
            finished = sorted(led.finished.items())
            totals, seconds = dict(led.totals), dict(led.seconds)
            totals["prompt_cache_hits"] = led.prompt_cache_hits
        c = CounterMetricFamily(PREFIX + "requests", "HTTP requests by endpoint and status",
                                labels=["endpoint", "status"])
        for (endpoint, status), n in requests:
            c.add_metric([endpoint, str(status)], n)
        yield c
        c = CounterMetricFamily(PREFIX + "finished", "generations by finish reason", labels=["reason"])
        for reason, n in finished:
            c.add_metric([reason], n)
        yield c
        for k, v in totals.items():
            name = f"expert_{k}" if k in ("hits", "misses", "evictions") else k
            yield CounterMetricFamily(PREFIX + name, f"sum of telemetry {k} over requests", value=v)
        for k, v in seconds.items():
            yield CounterMetricFamily(f"{PREFIX}{k}_seconds", f"sum of {k} time over requests", value=round(v, 6))
        for name, (value, doc) in self.gauges().items():
            yield GaugeMetricFamily(PREFIX + name, doc, value=value)


def prompt_cache_gauges(rt) -> dict[str, tuple[float, str]]:
    """The prompt cache's store (engine/prompt_cache.py) as gauges; zeros when it is off."""
    r = rt.prompt_cache.report() if rt.prompt_cache is not None else {}
    return {"prompt_cache_budget_bytes": (rt.plan.P, "prompt cache budget P (0: off)"),
            "prompt_cache_held_bytes": (r.get("held_bytes", 0), "bytes of saved prompts held"),
            "prompt_cache_entries": (r.get("entries", 0), "saved prompts held")}


class Metrics:
    """The server's registry (its own, not the process-global one, so two apps in one process,
    as in the tests, do not collide)."""

    def __init__(self, ledger, gauges: Callable[[], dict[str, tuple[float, str]]]):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_LedgerCollector(ledger, gauges))
        h = lambda name, doc, buckets: Histogram(PREFIX + name, doc, buckets=buckets, registry=self.registry)
        self.ttft = h("request_ttft_seconds", "time to first token per generation", SECONDS_BUCKETS)
        self.decode = h("request_decode_tokens_per_second", "decode tok/s per generation (two tokens or more)",
                        TOK_S_BUCKETS)
        self.stall = h("request_read_stall_seconds", "time a generation waited on expert reads "
                       "(demand loads and late prefetches)", SECONDS_BUCKETS)
        ledger.listeners.append(self.observe)

    def observe(self, telemetry: dict) -> None:
        self.ttft.observe(telemetry["ttft_s"])
        if telemetry["completion_tokens"] > 1:
            self.decode.observe(telemetry["decode_tok_s"])
        self.stall.observe(telemetry["demand_load_s"] + telemetry["prefetch_stall_s"])

    def render(self, accept: str | None) -> tuple[bytes, str]:
        """(body, content type) for the scraper's Accept header."""
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type
