"""`mawforge serve --max-batch N`: continuous batching behind the same OpenAI endpoints. Greedy
answers of concurrent clients (streamed and whole) equal each request's answer alone; requests
really share steps; a client that goes away mid-stream leaves the others streaming; the queue
beyond --max-waiting answers 429; the CLI plans each sequence's KV."""
import contextlib
import re
import subprocess
import sys
import threading

import httpx
import openai
import pytest
import torch

from mawforge.engine.generate import generate
from mawforge.engine.runtime import Runtime, RuntimeOptions
from mawforge.engine.sampling import SamplingParams
from mawforge.pack.packer import pack
from mawforge.serve.app import ServerThread, build_app

from test_serve import log_lines, stream_text, wait_for

CONTEXT, MODEL, BATCH = 256, "tiny-qwen3", 4
RT_OPTS = dict(context=CONTEXT, expert_cache_percent=50, threads=1, prefetch="none")


@pytest.fixture(scope="module")
def pack_dir(fixtures_root, tmp_path_factory):
    out = tmp_path_factory.mktemp("serve_batch") / "pack"
    pack(fixtures_root["qwen3_moe"]["gguf"]["Q8_0"], out, progress=False)
    return out


@pytest.fixture(scope="module")
def rt(pack_dir):
    threads = torch.get_num_threads()
    runtime = Runtime(pack_dir, RuntimeOptions(**RT_OPTS, max_batch=BATCH))
    yield runtime
    runtime.close()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def server(rt, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve_batch_log") / "telemetry.jsonl"
    app = build_app(rt, MODEL, max_tokens_default=8, telemetry_log=str(log), max_batch=BATCH, queue_size=8)
    with ServerThread(app) as s:
        s.log, s.worker = log, app.state.worker
        yield s


def _client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_concurrent_greedy_answers_equal_answers_alone_and_share_steps(pack_dir, rt, server):
    prompts = [f"Question number {i}: what is {i} plus {i}?" for i in range(8)]
    lengths = [5, 9, 3, 12, 7, 4, 10, 6]
    solo = Runtime(pack_dir, RuntimeOptions(**RT_OPTS, prompt_cache_gib=0))
    try:
        alone = []
        for p, n in zip(prompts, lengths):
            ids = solo.tokenizer.encode(p)
            alone.append([e.token for e in generate(solo, ids, SamplingParams(max_tokens=n, ignore_eos=True))])
    finally:
        solo.close()
    worker = server.worker
    steps0 = worker.batch.steps
    got, errors, barrier = [None] * 8, [], threading.Barrier(8)
    client = _client(server)

    def one(i):
        try:
            barrier.wait()
            kw = dict(model=MODEL, prompt=prompts[i], temperature=0, max_tokens=lengths[i],
                      extra_body={"ignore_eos": True})
            if i % 2:
                got[i] = "".join(stream_text(client.completions.create(**kw, stream=True))[0])
            else:
                got[i] = client.completions.create(**kw).choices[0].text
        except Exception as e:   # reported below with the index
            errors.append((i, e))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert got == [rt.tokenizer.decode(a) for a in alone]
    assert worker.batch.peak >= 2 and worker.batch.steps > steps0
    lines = log_lines(server.log)
    assert sum(line["status"] == 200 for line in lines) >= 8
    # each request's telemetry is its own: its tokens, and a share of the reads that add up
    assert sorted(line["telemetry"]["completion_tokens"] for line in lines[-8:]) == sorted(lengths)


def test_a_client_leaving_mid_stream_does_not_stop_the_others(server):
    body = {"model": MODEL, "prompt": "Tell me a long story", "max_tokens": 200, "stream": True,
            "ignore_eos": True}
    other: dict = {}

    def steady():
        c = _client(server)
        other["text"] = stream_text(c.completions.create(model=MODEL, prompt="Count with me", max_tokens=40,
                                                         temperature=0, stream=True,
                                                         extra_body={"ignore_eos": True}))[1]
    t = threading.Thread(target=steady)
    with httpx.Client(base_url=server.url) as h:
        with h.stream("POST", "/v1/completions", json=body) as r:
            t.start()
            assert next(r.iter_lines()).startswith("data: {")
        # leaving the block closes the connection mid-stream
    t.join(120)
    chunks = other["text"]
    assert chunks[-1].choices[0].finish_reason == "length"
    wait_for(lambda: any(line["status"] == 499 for line in log_lines(server.log)), "the 499 line")


def test_beyond_max_waiting_the_server_answers_429(server):
    worker = server.worker
    long = {"model": MODEL, "prompt": "Go on and on", "max_tokens": 230, "ignore_eos": True, "stream": True}
    statuses = []
    with httpx.Client(base_url=server.url, timeout=120) as h, contextlib.ExitStack() as streams:
        for _ in range(BATCH):
            streams.enter_context(h.stream("POST", "/v1/completions", json=long))
        wait_for(lambda: worker.active == BATCH, "every slot busy")
        for _ in range(worker.q.maxsize):
            threading.Thread(target=lambda: statuses.append(
                httpx.post(server.url + "/v1/completions", json={**long, "stream": False},
                           timeout=300).status_code)).start()
        wait_for(lambda: worker.queue_depth == worker.q.maxsize, "the queue full")
        r = h.post("/v1/completions", json={**long, "stream": False})
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
        assert int(r.headers["Retry-After"]) >= 1
    wait_for(lambda: len(statuses) == worker.q.maxsize, "the queued requests answered", 300)
    assert statuses == [200] * worker.q.maxsize


def test_cli_plans_the_kv_of_every_sequence(pack_dir):
    p = subprocess.run([sys.executable, "-m", "mawforge.cli", "plan", "--pack", str(pack_dir), "--context",
                        str(CONTEXT), "--max-batch", "3"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert re.search(r"K  KV cache.*3 sequences", p.stdout)


def test_a_reader_that_never_reads_is_cancelled_and_the_others_go_on(rt, server):
    """A job whose client reads nothing (a Channel on a loop that never runs) is cancelled once
    max_unread events wait; a request beside it completes."""
    import asyncio

    from mawforge.serve.worker import Channel, Job
    stalled = Channel.__new__(Channel)
    stalled.loop, stalled.q = asyncio.new_event_loop(), asyncio.Queue()
    stalled.max_unread, stalled.sent, stalled.taken = 5, 0, 0
    stalled.loop.call_soon_threadsafe = lambda *a: None            # nobody will ever take these
    ids = rt.tokenizer.encode("Never read")
    job = Job("stalled-1", "/v1/completions", ids, SamplingParams(max_tokens=200, ignore_eos=True), stalled,
              stream=True)
    server.worker.submit(job)
    other = _client(server).completions.create(model=MODEL, prompt="Meanwhile", max_tokens=20, temperature=0,
                                               extra_body={"ignore_eos": True})
    assert other.usage.completion_tokens == 20
    wait_for(lambda: any(line["request_id"] == "stalled-1" for line in log_lines(server.log)), "its log line")
    line = next(line for line in log_lines(server.log) if line["request_id"] == "stalled-1")
    assert job.cancel.is_set() and line["status"] == 499
    assert line["telemetry"]["finish_reason"] == "cancelled" and line["telemetry"]["completion_tokens"] <= 7
    stalled.loop.close()


def test_serve_preload_fills_the_expert_cache_before_the_first_request(pack_dir):
    """A server whose plan holds every expert reads them all in before the first request (so the
    first turn is as fast as the next); `--no-preload` starts with an empty cache; a cache of part of
    the experts starts empty unless `--preload` asks (then it is filled)."""
    import argparse

    from mawforge.commands.serve import add_arguments, app_for, plan_served
    from mawforge.serve.servecli import chat_settings

    held = {}
    for pct, flag in (("100", []), ("100", ["--no-preload"]), ("50", []), ("50", ["--preload"])):
        p = argparse.ArgumentParser()
        add_arguments(p)
        a = p.parse_args(["--pack", str(pack_dir), "--context", str(CONTEXT), "--expert-cache-percent", pct,
                          "--threads", "1", "--no-dashboard", *flag])
        opts, _, run_plan = plan_served(a)
        app, model = app_for(a, opts, run_plan, chat_settings(a))
        try:
            cache = model.runtime.cache
            held[(pct, *flag)] = (cache.held, cache.capacity)
        finally:
            model.close()
    assert held[("100",)][0] > 0.9 * held[("100",)][1] and held[("100", "--no-preload")][0] == 0
    assert held[("50",)][0] == 0 and held[("50", "--preload")][0] > 0.9 * held[("50", "--preload")][1]
