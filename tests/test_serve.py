"""`mawforge serve`: the official openai client and raw HTTP against the server on a free port
(in-process thread), plus one subprocess run of the real command (plan rejection, SIGTERM)."""
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import torch

from mawforge.engine.generate import generate
from mawforge.engine.runtime import Runtime, RuntimeOptions
from mawforge.engine.sampling import SamplingParams
from mawforge.pack.packer import pack
from mawforge.plan import Budget
from mawforge.serve.app import ServerThread, build_app
from mawforge.telemetry import SCHEMA

CONTEXT, MAX_TOKENS, MODEL = 256, 8, "tiny-qwen3"
CHAT = [{"role": "user", "content": "Tell me about expert caches."}]
RT_OPTS = dict(context=CONTEXT, budget=Budget(2 << 30, "test"), expert_cache_percent=50, threads=1)


@pytest.fixture(scope="module")
def pack_dir(fixtures_root, tmp_path_factory):
    out = tmp_path_factory.mktemp("serve") / "pack"
    pack(fixtures_root["qwen3_moe"]["gguf"]["Q8_0"], out, progress=False)
    return out


@pytest.fixture(scope="module")
def rt(pack_dir):
    threads = torch.get_num_threads()
    runtime = Runtime(pack_dir, RuntimeOptions(**RT_OPTS))
    yield runtime
    runtime.close()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def log_path(tmp_path_factory):
    return tmp_path_factory.mktemp("serve_log") / "telemetry.jsonl"


@pytest.fixture(scope="module")
def server(rt, log_path):
    with ServerThread(build_app(rt, MODEL, max_tokens_default=MAX_TOKENS, telemetry_log=str(log_path))) as s:
        yield s


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def log_lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def wait_for(cond, what: str, limit_s: float = 60.0):
    """Wait for a state (not a time): fails only if the state never comes."""
    end = time.monotonic() + limit_s
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.01)


def stream_text(stream) -> tuple[list[str], list]:
    pieces, chunks = [], list(stream)
    for c in chunks:
        for ch in c.choices:
            if hasattr(ch, "delta"):
                piece = ch.delta.content
            else:   # completions: the finish chunk has empty text and is not a token
                piece = ch.text if ch.finish_reason is None else None
            if piece is not None:
                pieces.append(piece)
    return pieces, chunks


def test_models_health_and_auth_free_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    h = httpx.get(server.url + "/health").json()
    assert h["status"] == "ok" and h["model"] == MODEL
    assert httpx.get(server.url + "/metrics").text.startswith("# HELP mawforge_")


def test_chat_matches_engine_and_carries_usage_and_telemetry(rt, client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=MAX_TOKENS)
    ids = rt.tokenizer.encode(rt.tokenizer.chat.render(CHAT, add_generation_prompt=True))
    events = list(generate(rt, ids, SamplingParams(max_tokens=MAX_TOKENS)))   # the server is idle now
    assert r.choices[0].message.content == "".join(e.text for e in events)
    assert r.choices[0].finish_reason == events[-1].finish_reason
    tel = r.model_extra["telemetry"]
    assert tel["schema"] == SCHEMA and tel["pack_digest"] == rt.manifest.pack_digest
    assert r.usage.prompt_tokens == tel["prompt_tokens"] == len(ids)
    assert r.usage.completion_tokens == tel["completion_tokens"] == len(events)
    assert r.usage.total_tokens == len(ids) + len(events)
    assert tel["hits"] + tel["misses"] > 0 and tel["speculative"]["mode"] == "off"


def test_completion_stream_has_one_chunk_per_token_and_matches_non_stream(client):
    whole = client.completions.create(model=MODEL, prompt="The cache holds", temperature=0, max_tokens=6)
    pieces, chunks = stream_text(client.completions.create(
        model=MODEL, prompt="The cache holds", temperature=0, max_tokens=6, stream=True,
        stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == whole.usage.completion_tokens == 6
    assert len(pieces) == last.usage.completion_tokens == last.model_extra["telemetry"]["completion_tokens"]
    assert "".join(pieces) == whole.choices[0].text
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason == "length"


def test_chat_stream_without_usage_puts_telemetry_on_the_finish_chunk(client):
    pieces, chunks = stream_text(client.chat.completions.create(
        model=MODEL, messages=CHAT, temperature=0, max_tokens=5, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    final = chunks[-1]
    assert final.choices[0].finish_reason == "length" and final.usage is None
    assert final.model_extra["telemetry"]["completion_tokens"] == len(pieces) == 5


def test_stop_string_cuts_the_text(client):
    full = client.completions.create(model=MODEL, prompt="The cache holds", temperature=0, max_tokens=8)
    text = full.choices[0].text
    stop = next((text[i:i + 2] for i in range(1, len(text) - 1) if text[i:i + 2].strip() == text[i:i + 2]), None)
    assert stop, f"no usable stop string in {text!r}"
    r = client.completions.create(model=MODEL, prompt="The cache holds", temperature=0, max_tokens=8,
                                  stop=[stop, "never-there"])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[:text.index(stop)]


def test_seed_top_k_and_min_p_reach_the_sampler(client):
    ask = lambda **kw: client.completions.create(model=MODEL, prompt="The cache holds", max_tokens=8,
                                                 **kw).choices[0].text
    greedy = ask(temperature=0)
    assert ask(temperature=1.0, extra_body={"top_k": 1}) == greedy          # top-1 sampling is greedy
    assert ask(temperature=1.0, extra_body={"min_p": 0.999999}) == greedy   # so is min_p near 1
    seeded = [ask(temperature=1.5, seed=7) for _ in range(2)]
    assert seeded[0] == seeded[1]


@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/chat/completions", b'{"model": "tiny-qwen3", "messages": [', 400, None),
    ("/v1/chat/completions", b'[1, 2]', 400, None),
    ("/v1/chat/completions", json.dumps({"model": "gpt-4", "messages": CHAT}).encode(), 404, "model"),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": CHAT, "temperature": 7}).encode(), 400,
     "temperature"),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": CHAT, "temperature": "hot"}).encode(), 400,
     "temperature"),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": []}).encode(), 400, "messages"),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": CHAT, "n": 0}).encode(), 400, "n"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "cache " * 400}).encode(), 400, "prompt"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 0}).encode(), 400, "max_tokens"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": [10 ** 9]}).encode(), 400, "prompt"),
    ("/v1/embeddings", b"{}", 404, None),
])
def test_bad_requests_get_openai_error_bodies(server, path, body, status, param):
    r = httpx.post(server.url + path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["param"] == param
    if b"cache cache" in body:
        assert err["code"] == "context_length_exceeded"
    # the server is still fine afterwards
    assert httpx.get(server.url + "/health").status_code == 200


def test_sixteen_concurrent_clients_each_get_their_own_answer(server, client):
    prompts = [[{"role": "user", "content": f"Question number {i}: what is {i} plus {i}?"}] for i in range(16)]
    ask = lambda m, stream: client.chat.completions.create(model=MODEL, messages=m, temperature=0,
                                                           max_tokens=6, stream=stream)
    alone = [ask(m, False).choices[0].message.content for m in prompts]
    assert len(set(alone)) > 1, "the prompts should lead to different answers"
    got, errors, barrier = [None] * 16, [], threading.Barrier(16)

    def one(i):
        try:
            barrier.wait()
            if i % 2:
                got[i] = "".join(stream_text(ask(prompts[i], True))[0])
            else:
                got[i] = ask(prompts[i], False).choices[0].message.content
        except Exception as e:   # reported below with the index
            errors.append((i, e))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and got == alone


class Gate:
    """Wraps generate: after the first token the engine waits until released or cancelled."""

    def __init__(self):
        self.started, self.release, self.cancelled = threading.Event(), threading.Event(), threading.Event()

    def generate(self, rt, prompt, params, cancelled):
        for i, ev in enumerate(generate(rt, prompt, params, cancelled=cancelled)):
            yield ev
            if i == 0:
                self.started.set()
                while not self.release.wait(0.01):
                    if cancelled():
                        self.cancelled.set()
                        break


@pytest.fixture
def gated(rt, tmp_path):
    gate, log = Gate(), tmp_path / "gated.jsonl"
    with ServerThread(build_app(rt, MODEL, queue_size=1, telemetry_log=str(log), generate_fn=gate.generate)) as s:
        yield gate, s, log
        gate.release.set()


def test_disconnect_mid_stream_cancels_and_frees_the_engine(gated):
    gate, s, log = gated
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 100, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=s.url) as h:
        with h.stream("POST", "/v1/chat/completions", json=body) as r:
            first = next(r.iter_lines())
            assert first.startswith("data: {")
        # leaving the block closes the connection mid-stream
    assert gate.cancelled.wait(60), "the engine never saw the disconnect"
    gate.release.set()
    nxt = httpx.post(s.url + "/v1/completions", json={"prompt": "next", "max_tokens": 3, "ignore_eos": True},
                     timeout=60)      # sampled: without ignore_eos an end-of-text token may come first
    assert nxt.status_code == 200 and nxt.json()["usage"]["completion_tokens"] == 3
    lines = log_lines(log)
    assert [line["status"] for line in lines] == [499, 200]
    assert lines[0]["telemetry"]["finish_reason"] == "cancelled"
    assert lines[0]["telemetry"]["completion_tokens"] < 100


def test_disconnect_while_waiting_for_a_whole_answer_cancels(gated):
    gate, s, log = gated
    host, port = s.url.removeprefix("http://").split(":")
    payload = json.dumps({"prompt": "hello", "max_tokens": 100, "ignore_eos": True}).encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        assert gate.started.wait(60)
    assert gate.cancelled.wait(60), "the engine never saw the disconnect"
    wait_for(lambda: log.exists() and log.read_text().strip(), "the telemetry line")
    line = log_lines(log)[0]
    assert line["status"] == 499 and line["telemetry"]["finish_reason"] == "cancelled"


def test_full_queue_answers_429_with_retry_after(gated):
    gate, s, log = gated
    results = {}

    def post(name):
        # ignore_eos: a first token that ends the answer would return it before the gate opens
        # and let the next request start at once (a rare flake, never queued)
        results[name] = httpx.post(s.url + "/v1/completions",
                                   json={"prompt": name, "max_tokens": 2, "ignore_eos": True}, timeout=60)

    a = threading.Thread(target=post, args=("first",))
    a.start()
    assert gate.started.wait(60)                      # the engine holds the first request
    b = threading.Thread(target=post, args=("second",))
    b.start()
    wait_for(lambda: httpx.get(s.url + "/health").json()["queue_depth"] == 1, "the second request queued")
    r = httpx.post(s.url + "/v1/completions", json={"prompt": "third", "max_tokens": 2})
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    assert r.json()["error"]["code"] == "queue_full" and r.json()["error"]["type"] == "rate_limit_error"
    gate.release.set()
    a.join()
    b.join()
    assert results["first"].status_code == results["second"].status_code == 200
    assert sorted(line["status"] for line in log_lines(log)) == [200, 200, 429]
    assert 'mawforge_requests_total{endpoint="/v1/completions",status="429"} 1' in httpx.get(s.url + "/metrics").text


def test_shutdown_cancels_in_flight_work_after_the_grace_and_answers_everyone(rt, tmp_path):
    gate, log, results = Gate(), tmp_path / "stop.jsonl", {}
    s = ServerThread(build_app(rt, MODEL, telemetry_log=str(log), generate_fn=gate.generate), grace_s=0.2).start()

    def post(name):
        results[name] = httpx.post(s.url + "/v1/completions",
                                   json={"prompt": name, "max_tokens": 50, "ignore_eos": True}, timeout=60)

    threads = [threading.Thread(target=post, args=(n,)) for n in ("running", "queued")]
    threads[0].start()
    assert gate.started.wait(60)
    threads[1].start()
    wait_for(lambda: httpx.get(s.url + "/health").json()["queue_depth"] == 1, "the second request queued")
    s.stop()                                          # the gate never opens: only shutdown can end it
    for t in threads:
        t.join()
    running, queued = results["running"], results["queued"]
    assert running.status_code == 200 and running.json()["choices"][0]["finish_reason"] == "cancelled"
    assert queued.status_code == 503 and queued.json()["error"]["code"] == "shutting_down"
    assert sorted(line["status"] for line in log_lines(log)) == [200, 503]


def test_api_key_is_required_when_set(rt):
    with ServerThread(build_app(rt, MODEL, api_key="sesame", max_tokens_default=2)) as s:
        bad = openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e:
            bad.completions.create(model=MODEL, prompt="hi")
        assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
        good = openai.OpenAI(base_url=s.url + "/v1", api_key="sesame", max_retries=0)
        assert good.completions.create(model=MODEL, prompt="hi").usage.completion_tokens >= 1


def test_telemetry_log_has_one_line_per_request_and_metrics_add_up(server, client, log_path):
    before = len(log_lines(log_path))
    client.completions.create(model=MODEL, prompt="one", max_tokens=3, temperature=0)
    httpx.post(server.url + "/v1/completions", content=b"not json")
    lines = log_lines(log_path)[before:]
    assert [(line["endpoint"], line["status"]) for line in lines] == [("/v1/completions", 200),
                                                                     ("/v1/completions", 400)]
    assert lines[0]["request_id"].startswith("cmpl-") and lines[0]["telemetry"]["completion_tokens"] == 3
    assert lines[1]["telemetry"] is None and "JSON" in lines[1]["error"]
    everything = log_lines(log_path)
    text = httpx.get(server.url + "/metrics").text
    tokens = sum(line["telemetry"]["completion_tokens"] for line in everything if line["telemetry"])
    misses = sum(line["telemetry"]["misses"] for line in everything if line["telemetry"])
    assert f"mawforge_completion_tokens_total {tokens}" in text
    assert f"mawforge_expert_misses_total {misses}" in text
    assert "mawforge_queue_depth 0" in text


def _serve(pack_dir, *extra):
    return subprocess.Popen([sys.executable, "-m", "mawforge.cli", "serve", "--pack", str(pack_dir),
                             "--model-id", MODEL, "--port", "0", "--context", str(CONTEXT), "--threads", "1",
                             "--expert-cache-percent", "50", "--no-speculative", "--policy", "lru", *extra],
                            stderr=subprocess.PIPE, text=True)


def test_cli_refuses_a_rejected_plan(pack_dir):
    p = _serve(pack_dir, "--memory-budget-gib", "0.001")
    _, err = p.communicate(timeout=120)
    assert p.returncode == 4 and "plan rejected" in err and "listening" not in err


def test_cli_serves_then_finishes_in_flight_work_on_sigterm(pack_dir, tmp_path):
    log, trace = tmp_path / "t.jsonl", tmp_path / "trace.npz"
    p = _serve(pack_dir, "--memory-budget-gib", "2", "--max-tokens-default", "4", "--telemetry-log", str(log),
               "--trace-out", str(trace))
    try:
        url = None
        for line in p.stderr:
            m = re.search(r"listening on (http://\S+)", line)
            if m:
                url = m.group(1)
                break
        assert url, "the server never said where it listens"
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        assert c.chat.completions.create(model=MODEL, messages=CHAT).usage.completion_tokens <= 4
        stream = c.completions.create(model=MODEL, prompt="long", max_tokens=120, stream=True,
                                      extra_body={"ignore_eos": True})
        chunks = [next(iter(stream))]
        p.send_signal(signal.SIGTERM)
        chunks += list(stream)                       # the in-flight stream still completes
        assert p.wait(timeout=120) == 0
    finally:
        if p.poll() is None:
            p.kill()
    assert chunks[-1].choices[0].finish_reason in ("length", "cancelled")
    assert chunks[-1].model_extra["telemetry"]["completion_tokens"] == len(chunks) - 1
    lines = log_lines(log)
    assert len(lines) == 2 and lines[1]["stream"] and lines[1]["telemetry"]["prompt_tokens"] >= 1
    assert trace.exists()


def test_per_request_speculation_keeps_greedy_output_and_reports_it(server, client):
    plain = client.completions.create(model=MODEL, prompt="The cache holds the cache holds", temperature=0,
                                      max_tokens=12)
    spec = client.completions.create(model=MODEL, prompt="The cache holds the cache holds", temperature=0,
                                     max_tokens=12, extra_body={"speculative": "ngram"})
    assert spec.choices[0].text == plain.choices[0].text
    tel = spec.model_extra["telemetry"]["speculative"]
    # Whether prompt lookup finds a draft depends on what this random model emits (drafting
    # itself is tested on covering prompts in test_speculative); here the request's override
    # must reach the speculator and its accounting must add up step by step.
    steps = tel["steps"]
    assert tel["mode"] == "ngram" and len(steps) == tel["verify_steps"] + tel["plain_steps"] >= 1
    assert (tel["drafted"] == sum(st["drafted"] for st in steps)
            >= tel["accepted"] == sum(st["accepted"] for st in steps))
    assert tel["verify_steps"] == sum(1 for st in steps if st["drafted"])
    # prefill emits the first token, each step one plus its accepted drafts
    assert 1 + sum(1 + st["accepted"] for st in steps) >= spec.usage.completion_tokens
    assert plain.model_extra["telemetry"]["speculative"]["mode"] == "off"
    r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "x", "speculative": "maybe"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "speculative"
