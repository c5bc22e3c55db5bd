"""What `serve --replicas N` shows of all its replicas: one `/metrics` with every replica's
samples labelled `replica="NAME"` (each replica's own registry, parsed and relabelled, plus the
ingress's routing counters), and the page at `/` that lists the replicas, each linking to its own
dashboard at /replicas/NAME/ (serve/dashboard.py, unchanged, served through the ingress)."""
from __future__ import annotations

import html

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.parser import text_string_to_metric_families

from mawforge.serve.metrics import PREFIX


class _Merged:
    """Every replica's families, each sample labelled with its replica, then the ingress's own."""

    def __init__(self, texts: dict[str, str], routing: dict[str, dict]):
        self.texts, self.routing = texts, routing

    def collect(self):
        families: dict[str, Metric] = {}
        for name, text in self.texts.items():
            for fam in text_string_to_metric_families(text):
                merged = families.get(fam.name)
                if merged is None:
                    merged = families[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                for s in fam.samples:
                    merged.add_sample(s.name, {"replica": name, **s.labels}, s.value, s.timestamp, s.exemplar)
        yield from families.values()
        up = GaugeMetricFamily(PREFIX + "replica_up", "1 while the ingress routes to the replica", labels=["replica"])
        routed = CounterMetricFamily(PREFIX + "replica_routed", "requests the ingress sent to the replica",
                                     labels=["replica"])
        lost = CounterMetricFamily(PREFIX + "replica_failures", "calls to the replica that failed because it was "
                                   "unreachable or died (each answered 503)", labels=["replica"])
        for name, r in self.routing.items():
            up.add_metric([name], int(r["up"]))
            routed.add_metric([name], r["routed"])
            lost.add_metric([name], r["failures"])
        yield from (up, routed, lost)


def merged_metrics(texts: dict[str, str], routing: dict[str, dict], accept: str | None) -> tuple[bytes, str]:
    """(body, content type): the replicas' expositions (Prometheus text) as one."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(texts, routing))
    encoder, content_type = choose_encoder(accept or "")
    return encoder(registry), content_type


def overview_page(model_id: str, replicas: dict[str, dict]) -> str:
    """The replicas at a glance: state, node, plan F and budget, queue; each links to its dashboard."""
    gib = lambda b: f"{b / 2**30:.2f} GiB" if b else "none"
    rows = []
    for name, r in replicas.items():
        info = r.get("info") or {}
        plan = info.get("plan") or {}
        state = "up" if r["up"] else "down (Ray restarts it; its conversations go to the others)"
        rows.append(f"<tr><td><a href='replicas/{html.escape(name)}/'>{html.escape(name)}</a></td>"
                    f"<td>{html.escape(state)}</td><td>{html.escape(str(info.get('host', '?')))} "
                    f"(pid {info.get('pid', '?')})</td><td>{gib(plan.get('F'))}</td>"
                    f"<td>{gib(plan.get('budget_bytes'))}</td><td>{info.get('queue_depth', '')}</td>"
                    f"<td>{int(bool(info.get('busy')))}</td><td>{r['routed']}</td><td>{r['failures']}</td></tr>")
    return ("<!doctype html><html><head><meta charset='utf-8'><title>MawForge replicas</title>"
            "<link rel='stylesheet' href='replicas/" + html.escape(next(iter(replicas), "")) +
            "/dashboard/static/dashboard.css'></head><body><main>"
            f"<h1>MawForge · {html.escape(model_id)} · {len(replicas)} replicas on Ray Serve</h1>"
            "<p>One OpenAI endpoint at /v1; a conversation goes back to the replica that holds its prompt cache. "
            "Each replica's live dashboard is behind its name; <a href='metrics'>/metrics</a> labels every "
            "sample with its replica.</p><table><thead><tr><th>replica</th><th>state</th><th>host</th>"
            "<th>planned F</th><th>budget</th><th>queue</th><th>busy</th><th>routed</th><th>failures</th>"
            "</tr></thead><tbody>" + "".join(rows) + "</tbody></table></main></body></html>")
