"""The dashboard of `mawforge serve`, in a real browser: headless Chromium from the system's
packages driven by Playwright (never a downloaded browser). The server runs in-process on a
tiny synthetic Qwen3-MoE pack (8 layers x 32 experts) with an API key, so the key form, the
cookie-guarded event stream and the Bearer chat are all on the path. Also, without a browser:
what the key guards, the cache core's per-block counts, and the prometheus-client /metrics.

MAWFORGE_DASHBOARD_SCREENSHOT=docs/dashboard.png writes the README's screenshot as well."""
from __future__ import annotations

import json
import os
import shutil

import httpx
import numpy as np
import pytest
from helpers import dashboard_pack

from mawforge.cache.core import HEAT_FIELDS, CacheCore
from mawforge.cache.driver import RouteDriver
from mawforge.cache.policies import make_policy
from mawforge.engine.runtime import Runtime, RuntimeOptions
from mawforge.plan import Budget
from mawforge.serve.app import ServerThread, build_app

MODEL, KEY = "dash-synth", "sesame"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-quic"]
PROMPT = "What does an expert cache keep, and what does it read from the pack when a layer asks for it?"


def chromium() -> str | None:
    for path in (os.environ.get("MAWFORGE_CHROMIUM"), shutil.which("chromium"), shutil.which("chromium-browser")):
        if path and os.access(path, os.X_OK):
            return path
    return None


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    pack_dir = dashboard_pack(tmp_path_factory.mktemp("dashboard"))
    rt = Runtime(pack_dir, RuntimeOptions(context=512, budget=Budget(1 << 29, "test"), expert_cache_percent=30,
                                          threads=1))
    with ServerThread(build_app(rt, MODEL, api_key=KEY, max_tokens_default=16)) as s:
        yield s
    rt.close()


def events(url: str, n: int, **kw) -> list[tuple[str, dict]]:
    """The first n server-sent events of the dashboard stream."""
    out, name = [], None
    with httpx.stream("GET", url + "/dashboard/events", timeout=30, **kw) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                out.append((name, json.loads(line[6:])))
                if len(out) == n:
                    return out
    return out


def test_the_api_key_guards_the_page_and_its_stream(server):
    page = httpx.get(server.url + "/")
    assert page.status_code == 401 and "key-form" in page.text and "dashboard.js" not in page.text
    assert httpx.get(server.url + "/dashboard/events").status_code == 401
    assert httpx.get(server.url + "/dashboard/api/requests").status_code == 401
    assert httpx.get(server.url + "/", cookies={"mawforge_key": "wrong"}).status_code == 401
    assert "dashboard.js" in httpx.get(server.url + "/", cookies={"mawforge_key": KEY}).text
    hello, frame = events(server.url, 2, headers={"Authorization": f"Bearer {KEY}"})
    assert hello[0] == "hello" and hello[1]["n_layers"] == 8 and hello[1]["n_experts"] == 32
    assert frame[0] == "frame" and set(frame[1]["events"]) == set(HEAT_FIELDS)
    assert events(server.url, 1, cookies={"mawforge_key": KEY})[0][0] == "hello"
    r = httpx.get(server.url + "/dashboard/api/replay/chatcmpl-nope", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_metrics_keep_their_names_and_add_histograms(server):
    r = httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": MODEL, "prompt": "The cache", "max_tokens": 4, "temperature": 0})
    tel = r.json()["telemetry"]
    assert httpx.get(server.url + "/metrics").status_code == 401      # behind the key, as llama-server
    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    assert text.startswith("# HELP mawforge_") and "# TYPE mawforge_requests_total counter" in text
    assert 'mawforge_requests_total{endpoint="/v1/completions",status="200"}' in text
    assert "# TYPE mawforge_queue_depth gauge" in text
    for name in ("request_ttft_seconds", "request_decode_tokens_per_second", "request_read_stall_seconds"):
        assert f"# TYPE mawforge_{name} histogram" in text
    count = [float(line.split()[-1]) for line in text.splitlines()
             if line.startswith("mawforge_request_ttft_seconds_count")]
    assert count and count[0] >= 1
    assert tel["completion_tokens"] == 4


def test_heat_counts_add_up_to_the_layer_counters():
    rng = np.random.default_rng(0)
    core = CacheCore(6 * 100, make_policy("lru"))
    core.access((1, 3), 100)                      # resident before counting starts
    core.track_heat(3, 8)
    driver = RouteDriver(core, lambda layer, expert: 100)
    for _ in range(50):
        driver.begin_step("decode", 1)
        for layer in range(3):
            for _ in driver.layer(layer, rng.choice(8, size=(1, 2), replace=False)):
                pass
        driver.end_step()
        driver.prefetch([(0, int(rng.integers(8)))])
    snap, stats = core.snapshot(), core.stats()
    total = lambda field: int(snap["heat"][HEAT_FIELDS.index(field)].sum())
    assert (total("hits"), total("misses") + 1, total("evictions")) == (stats.hits, stats.misses, stats.evictions)
    assert (total("prefetch_loads"), total("prefetch_useful"), total("prefetch_wasted")) == \
        (stats.prefetch_issued, stats.prefetch_useful, stats.prefetch_wasted)
    assert sorted(snap["resident"]) == sorted(core.resident()) and snap["used_bytes"] == core.used_bytes
    assert np.flatnonzero(snap["resident_map"]).tolist() == sorted(l * 8 + e for l, e in core.resident())


def _number(text: str):
    try:
        return float(text)
    except ValueError:
        return text


def test_dashboard_in_a_real_browser(server, tmp_path):
    exe = chromium()
    assert exe is not None, ("no Chromium found: `make test` installs Debian's chromium with apt-get; elsewhere "
                             "install it or set MAWFORGE_CHROMIUM to its path")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            page.goto(server.url + "/")
            page.fill("[data-testid=key]", KEY)                    # the key form, then the dashboard
            page.press("[data-testid=key]", "Enter")
            page.wait_for_function("window.mawforgeDashboard && window.mawforgeDashboard.frames > 1")
            shots = lambda: page.evaluate("[...document.querySelectorAll('canvas')].map(c => c.toDataURL())")
            before = shots()

            page.fill("[data-testid=prompt]", PROMPT)
            page.fill("#max-tokens", "96")
            with page.expect_response("**/v1/chat/completions") as answer:
                page.click("[data-testid=send]")
            page.wait_for_selector(".msg.assistant[data-state=done]", timeout=60_000)
            chunks = [json.loads(line[6:]) for line in answer.value.text().split("\n")
                      if line.startswith("data: ") and line != "data: [DONE]"]
            tel = chunks[-1]["telemetry"]
            rid = chunks[-1]["id"]
            streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
            assert page.inner_text(".msg.assistant") == streamed and tel["completion_tokens"] == 96

            # the numbers on the page are the response's telemetry, in the panel and the table
            shown = page.eval_on_selector_all("[data-testid=last-telemetry] dd",
                                              "ds => ds.map(d => [d.dataset.field, d.dataset.value])")
            assert len(shown) >= 10
            for field, value in shown:
                assert _number(value) == tel[field], field
            row = f"#requests tr[data-request-id='{rid}']"
            page.wait_for_selector(row)
            cells = page.eval_on_selector_all(row + " td[data-field]",
                                              "ts => ts.map(t => [t.dataset.field, t.dataset.value])")
            for field, value in cells:
                want = tel["demand_load_s"] + tel["prefetch_stall_s"] if field == "stall_s" else tel[field]
                assert _number(value) == want, field           # the same doubles, summed in the same order

            # the heatmap and the charts moved while it decoded
            page.wait_for_function("window.mawforgeDashboard.charts.tok_s "
                                   "&& window.mawforgeDashboard.charts.tok_s.length > 0")
            after = shots()
            assert after[0] != before[0], "heatmap did not change"
            assert sum(a != b for a, b in zip(after[1:], before[1:])) >= 3, "charts did not change"
            resident = page.evaluate("window.mawforgeDashboard.lastFrame.resident.length")
            assert resident > 0

            # replay of this request's route trace against Belady
            page.click(row)
            page.wait_for_selector("[data-testid=replay-row] >> nth=2")
            replay = httpx.get(f"{server.url}/dashboard/api/replay/{rid}",
                               headers={"Authorization": f"Bearer {KEY}"}).json()
            rates = {r["policy"]: r for r in replay["rows"]}
            assert rates["belady"]["misses"] <= rates["s3fifo"]["misses"]     # the live (default) policy
            assert replay["live"]["hits"] == tel["hits"] and replay["live"]["misses"] == tel["misses"]
            assert "Belady" in page.inner_text("[data-testid=replay]")

            page.evaluate("document.activeElement.blur()")
            shot = tmp_path / "dashboard.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 10_000
            target = os.environ.get("MAWFORGE_DASHBOARD_SCREENSHOT")
            if target:
                shutil.copyfile(shot, target)
        finally:
            browser.close()
