"""The server under a bounded storm on 127.0.0.1 (mawforge/fuzz/storm.py): concurrent clients
(half streamed), malformed requests, disconnects, large bad bodies while /health is polled,
an overload burst, then SIGTERM with streams in flight. No 5xx, every malformed request a
4xx in OpenAI's error schema and a telemetry line, every good answer deterministic. Plus the
request limits one by one: unknown fields, max_tokens past the context, stop_token_ids."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

from mawforge.engine.generate import generate
from mawforge.engine.runtime import Runtime, RuntimeOptions
from mawforge.engine.sampling import SamplingParams
from mawforge.fuzz.storm import CHAT, COMP, PROMPTS, Result, Storm, _Http, _text, drain, malformed, storm
from mawforge.pack.packer import pack
from mawforge.plan import Budget
from mawforge.serve.app import ServerThread, build_app

CONTEXT, MODEL = 256, "storm"


@pytest.fixture(scope="module")
def tiny_pack(tmp_path_factory):
    from mawforge.synth import synth
    root = tmp_path_factory.mktemp("storm")
    g = synth(root / "tiny.gguf", 2, vocab=1024, hidden=256, n_head=4, n_head_kv=2, head_dim=64, n_expert=8,
              n_expert_used=2, expert_ff=256, dense_ff=512, report=False, progress=False)
    pack(g, root / "pack", progress=False)
    return root / "pack"


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=60) as r:
        return r.read().decode()


@pytest.mark.parametrize("max_batch,clients", [(1, 6), (4, 16)], ids=["one-at-a-time", "batching"])
def test_storm_gets_no_5xx_and_every_request_is_answered_and_logged(tiny_pack, tmp_path, max_batch, clients):
    """One request at a time, and continuous batching (--max-batch 4, 16 clients): the same storm,
    and with batching every greedy answer equal to the same request's answer alone."""
    log = tmp_path / "telemetry.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "mawforge.cli", "serve", "--pack", str(tiny_pack), "--model-id",
                             MODEL, "--port", "0", "--context", str(CONTEXT), "--threads", "1", "--queue-size", "2",
                             "--memory-budget-gib", "2", "--expert-cache-percent", "100", "--no-speculative",
                             "--telemetry-log", str(log), "--shutdown-grace-s", "5", "--max-batch", str(max_batch)],
                            stderr=subprocess.PIPE, text=True)
    try:
        url = next(m.group(1) for line in proc.stderr if (m := re.search(r"listening on (http://\S+)", line)))
        cfg = Storm(clients=clients, requests=4 if max_batch == 1 else 2, disconnects=4, big_bodies=3, big_mb=2.0,
                    overload=10, in_flight_at_term=3)
        alone = solo_answers(url, cfg)
        res = storm(url, MODEL, cfg, CONTEXT)
        for _ in range(600):                      # quiescent: disconnected jobs cancelled, queue empty
            h = json.loads(_get(url + "/health"))
            if h["queue_depth"] == 0 and not h["busy"]:
                break
            time.sleep(0.05)
        metrics = _get(url + "/metrics")
        lines = [json.loads(x) for x in log.read_text().splitlines()]
        term = Result()
        drain(url, MODEL, cfg, term, proc.terminate)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    # concurrency: every good request answered, the same prompt gives the same text
    assert [s for _, s, _ in res.good] == [200] * (cfg.clients * cfg.requests)
    texts: dict = {}
    for key, _, text in res.good:
        texts.setdefault(key, set()).add(text)
    assert all(len(v) == 1 for v in texts.values())
    assert {k: v.pop() for k, v in texts.items()} == {k: alone[k] for k in texts}
    # malformed: each a 4xx with an OpenAI error body
    bad = [(n, s) for n, s, err in res.malformed if not 400 <= s < 500 or err is None]
    assert bad == [] and len(res.malformed) == len(malformed(MODEL, CONTEXT)) + 1
    assert res.big == [400] * cfg.big_bodies
    assert res.health_failures == 0 and len(res.health_ms) >= 1        # /health answered throughout
    assert set(res.overload) <= {200, 429} and res.overload[200] >= 1 and res.retry_after_missing == 0
    assert res.disconnects == cfg.disconnects
    # every request has its telemetry line and is counted in /metrics; none is a 5xx
    assert len(lines) == sum(res.sent.values()) + len(alone)
    assert not [x for x in lines if x["status"] >= 500]
    assert sum(1 for x in lines if 400 <= x["status"] < 500 and x["error"]) >= len(res.malformed) + cfg.big_bodies
    counted = sum(int(v) for v in re.findall(r'^mawforge_requests_total\{[^}]*\} (\d+)', metrics, re.M))
    assert counted == len(lines)
    # SIGTERM: the streams in flight end well-formed, queued ones get an answer too
    assert len(term.term_streams) == cfg.in_flight_at_term
    assert all(t in ("length", "cancelled", "stop", "status 503", "status 429") for t in term.term_streams)
    assert "length" in term.term_streams or "cancelled" in term.term_streams


def solo_answers(url: str, cfg: Storm) -> dict:
    """Each (path, prompt) of the storm's good clients asked alone, before the storm: the answers
    the storm's concurrent ones must equal."""
    h, out = _Http(url), {}
    for path in (COMP, CHAT):
        for i, prompt in enumerate(PROMPTS):
            body = {"model": MODEL, "temperature": 0, "max_tokens": cfg.max_tokens, "stream": False}
            body.update({"messages": [{"role": "user", "content": prompt}]} if path == CHAT else {"prompt": prompt})
            status, _, raw = h.post(path, body)
            assert status == 200
            out[(path, i)] = _text(path, status, raw, False)
    return out


@pytest.fixture(scope="module")
def served(tiny_pack, tmp_path_factory):
    threads = torch.get_num_threads()
    rt = Runtime(tiny_pack, RuntimeOptions(context=CONTEXT, budget=Budget(2 << 30, "test"), expert_cache_percent=100,
                                           threads=1))
    log = tmp_path_factory.mktemp("storm_log") / "t.jsonl"
    with ServerThread(build_app(rt, MODEL, max_tokens_default=8, telemetry_log=str(log))) as s:
        yield rt, _Http(s.url), log
    rt.close()
    torch.set_num_threads(threads)


def test_stop_token_ids_end_the_generation_at_that_token(served):
    rt, h, _ = served
    prompt = rt.tokenizer.encode("Stop tokens: one two three")
    toks = [ev.token for ev in generate(rt, prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))]
    stop = toks[2]
    status, _, raw = h.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0,
                                                "ignore_eos": True, "stop_token_ids": [stop]})
    body = json.loads(raw)
    assert status == 200 and body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == toks.index(stop) + 1


@pytest.mark.parametrize("extra,status,param,code", [
    ({"max_token": 5}, 400, "max_token", "unknown_parameter"),
    ({"max_tokens": 10**12}, 400, "max_tokens", "context_length_exceeded"),
    ({"max_completion_tokens": CONTEXT}, 400, "max_completion_tokens", "context_length_exceeded"),
    ({"stop_token_ids": [-1]}, 400, "stop_token_ids", None),
    ({"max_tokens": CONTEXT - 1}, 200, None, None),
    ({"user": "someone", "metadata": {"k": "v"}}, 200, None, None),     # known OpenAI fields, no effect on output
])
def test_request_limits(served, extra, status, param, code):
    _, h, log = served
    before = len(log.read_text().splitlines()) if log.exists() else 0
    got, _, raw = h.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, **extra})
    assert got == status
    if status != 200:
        err = json.loads(raw)["error"]
        assert err["param"] == param and err["code"] == code
        if code == "context_length_exceeded":
            assert str(CONTEXT) in err["message"]
    lines = log.read_text().splitlines()
    assert len(lines) == before + 1 and json.loads(lines[-1])["status"] == status
