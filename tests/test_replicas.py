"""`mawforge serve --replicas 2` on a local Ray cluster (ray.init in this process, 2 CPUs): two
replicas of the shipped demo model behind one endpoint, driven with the official openai client.
Both replicas answer; a conversation's later turns (plain and streamed, chat, completions and
Responses) go back to the replica that served its first (the X-MawForge-Replica header and the
per-replica /metrics say which); a replica killed mid-stream fails that stream with an error
event, not a hang, while the other replica's stream finishes; its conversations go to the other
replica while it is down, and Ray Serve restarts it. Routing itself (serve/affinity.py) is
checked without Ray first."""
import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import openai
import pytest

from mawforge.demo import demo_gguf
from mawforge.errors import BudgetRejected, MawError
from mawforge.pack.packer import pack
from mawforge.serve.affinity import Affinity, rendezvous, segments
from mawforge.commands.serve import add_arguments

MODEL, NAMES = "demo", ["r0", "r1"]


def chat(user: str, *more) -> list[dict]:
    return [{"role": "system", "content": "You are terse."}, {"role": "user", "content": user}, *more]


# ---- routing, without Ray ----------------------------------------------------------------------
def test_a_conversation_keeps_its_replica_across_turns_and_keys_spread():
    aff, up = Affinity(NAMES), set(NAMES)
    first, digests = aff.order("chat", {"messages": chat("hi")}, up)
    aff.routed(first[0], digests)
    later = {"messages": chat("hi", {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"})}
    assert aff.order("chat", later, up)[0][0] == first[0]
    # only the system prompt in common: rendezvous hashing spreads the conversations over both
    picks = {aff.order("chat", {"messages": chat(f"question {i}")}, up)[0][0] for i in range(32)}
    assert picks == set(NAMES)
    # the key is the messages up to the first user message; a completion's is its first block
    assert segments("chat", {"messages": chat("x")})[1] == 2
    assert segments("completion", {"prompt": "a" * 130})[0] == ["a" * 64, "a" * 64, "aa"]


def test_a_replica_that_is_down_moves_only_its_conversations_and_they_stay_moved():
    aff = Affinity(NAMES)
    body = next({"messages": chat(f"q{i}")} for i in range(64)
                if aff.order("chat", {"messages": chat(f"q{i}")}, set(NAMES))[0][0] == "r0")
    order, digests = aff.order("chat", body, {"r1"})
    assert order == ["r1"]
    aff.routed("r1", digests)                 # its prompt cache is on r1 now: it stays there when r0 is back
    assert aff.order("chat", body, set(NAMES))[0][0] == "r1"
    assert aff.order("chat", body, set())[0] == []
    assert rendezvous(b"k", NAMES) == rendezvous(b"k", list(reversed(NAMES)))


def test_a_growing_completion_prompt_and_a_previous_response_find_their_replica():
    aff, up = Affinity(NAMES), set(NAMES)
    prompt = "Once upon a time " * 8
    order, digests = aff.order("completion", {"prompt": prompt}, up)
    other = next(n for n in NAMES if n != order[0])
    aff.routed(other, digests, None)          # wherever it went, the longer prompt follows it
    assert aff.order("completion", {"prompt": prompt + " there lived a dragon"}, up)[0][0] == other
    aff.routed("r1", [], "resp_1")
    assert aff.order("responses", {"input": "next", "previous_response_id": "resp_1"}, up)[0][0] == "r1"


# ---- two replicas on a local Ray cluster ----------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_args(pack_dir, port, *extra) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(["--pack", str(pack_dir), "--port", str(port), "--replicas", "2", "--threads", "1",
                         "--memory-budget-gib", "1.5", "--context", "2048", "--model-id", MODEL, *extra])


@pytest.fixture(scope="module")
def demo_pack(tmp_path_factory):
    out = tmp_path_factory.mktemp("replicas") / "pack"
    pack(demo_gguf("Q4_K_M"), out, progress=False)
    return out


def test_the_command_serves_replicas_on_a_local_ray_and_stops_on_sigterm(demo_pack):
    """`mawforge serve --replicas 2` with no --ray-address: a local Ray of its own, stopped with it."""
    port, ray_dir = free_port(), tempfile.mkdtemp(prefix="ray")      # short: Ray's socket paths must fit 107 bytes
    p = subprocess.Popen([sys.executable, "-m", "mawforge.cli", "serve", "--pack", str(demo_pack), "--replicas", "2",
                          "--threads", "1", "--memory-budget-gib", "1.5", "--context", "512", "--model-id", MODEL,
                          "--port", str(port)], stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "RAY_TMPDIR": ray_dir})
    try:
        said = []
        for line in p.stderr:
            said.append(line)
            if "listening on" in line:
                break
        assert f"listening on http://127.0.0.1:{port} " in said[-1], "".join(said[-20:])
        url = f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        assert ask(client, chat("Hi"), max_tokens=2)[0] in NAMES
        assert {n for n, r in health(url).items() if r["up"]} == set(NAMES)
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=120) == 0 and "stopped" in p.stderr.read()
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(ray_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(demo_pack, tmp_path_factory):
    import ray
    from ray import serve

    from mawforge.serve.replicas import deploy

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             _temp_dir=str(tmp_path_factory.mktemp("ray")))
    try:
        url = deploy(serve_args(demo_pack, free_port()))
        yield argparse.Namespace(url=url, pack=demo_pack, client=openai.OpenAI(
            base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120))
        serve.shutdown()
    finally:
        ray.shutdown()


def ask(client, messages, **kw):
    """(replica, the answer's text) of one chat request, plain or streamed."""
    if kw.get("stream"):
        with client.chat.completions.with_streaming_response.create(model=MODEL, messages=messages, **kw) as r:
            text = "".join(c.choices[0].delta.content or "" for c in r.parse() if c.choices)
            return r.headers["x-mawforge-replica"], text
    r = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, **kw)
    return r.headers["x-mawforge-replica"], r.parse().choices[0].message.content


def conversations(client, n=12) -> dict[str, list[list[dict]]]:
    """First turns of conversations, by the replica that answered each."""
    by: dict[str, list] = {name: [] for name in NAMES}
    for i in range(n):
        msgs = chat(f"Tell me about topic {i}.")
        name, _ = ask(client, msgs, max_tokens=4, temperature=0)
        by[name].append(msgs)
    return by


def health(url) -> dict:
    return httpx.get(url + "/health", timeout=30).json()["replicas"]


def test_both_replicas_answer_and_each_conversation_returns_to_its_replica(cluster):
    client = cluster.client
    by = conversations(client)
    assert all(by.values()), {k: len(v) for k, v in by.items()}       # both replicas answered
    for name, convs in by.items():
        msgs = convs[0]
        _, text = ask(client, msgs, max_tokens=4, temperature=0)
        turn2 = msgs + [{"role": "assistant", "content": text}, {"role": "user", "content": "And then?"}]
        assert ask(client, turn2, max_tokens=4, temperature=0)[0] == name
        assert ask(client, turn2 + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "More."}],
                   max_tokens=4, temperature=0, stream=True)[0] == name
    # completions and Responses through the same endpoint; a previous_response_id finds its replica
    r = client.completions.with_raw_response.create(model=MODEL, prompt="Once upon a time", max_tokens=4)
    assert r.parse().choices[0].text is not None and r.headers["x-mawforge-replica"] in NAMES
    first = client.responses.with_raw_response.create(model=MODEL, input="Hello", max_output_tokens=4)
    nxt = client.responses.with_raw_response.create(model=MODEL, input="Again", max_output_tokens=4,
                                                    previous_response_id=first.parse().id)
    assert nxt.headers["x-mawforge-replica"] == first.headers["x-mawforge-replica"]
    assert client.responses.retrieve(first.parse().id).id == first.parse().id
    assert [m.id for m in client.models.list().data] == [MODEL]
    # one /metrics with every replica's samples labelled, the routing counters; the replicas page
    metrics = httpx.get(cluster.url + "/metrics", timeout=30).text
    for name in NAMES:
        assert f'mawforge_requests_total{{endpoint="/v1/chat/completions",replica="{name}",status="200"}}' in metrics
        assert f'mawforge_replica_up{{replica="{name}"}} 1.0' in metrics
        assert f'mawforge_planned_footprint_bytes{{replica="{name}"}}' in metrics
    page = httpx.get(cluster.url + "/", timeout=30)
    assert page.status_code == 200 and "replicas/r0/" in page.text and "replicas/r1/" in page.text
    board = httpx.get(cluster.url + "/replicas/r1", timeout=30, follow_redirects=True)
    assert board.status_code == 200 and "dashboard/static/dashboard.js" in board.text
    assert httpx.get(cluster.url + "/replicas/r1/dashboard/api/requests", timeout=30).status_code == 200


def test_a_replica_killed_mid_stream_fails_its_stream_the_other_goes_on_and_ray_restarts_it(cluster):
    import ray

    client, url = cluster.client, cluster.url
    by = conversations(client)
    victim, survivor = NAMES
    assert len(by[victim]) >= 3
    before = health(url)
    long = dict(max_tokens=1800, temperature=0, stream=True, extra_body={"ignore_eos": True})
    other: dict = {}

    def survivor_stream():
        with client.chat.completions.with_streaming_response.create(model=MODEL, messages=by[survivor][0],
                                                                    **long) as r:
            other["replica"] = r.headers["x-mawforge-replica"]
            other["chunks"] = sum(1 for c in r.parse() if c.choices and c.choices[0].delta.content is not None)

    def queued_behind():                                       # a plain request waiting on the victim
        try:
            client.chat.completions.create(model=MODEL, messages=by[victim][2], **{**long, "stream": False})
        except openai.APIStatusError as e:
            other["queued"] = (e.status_code, e.code)

    t, q = threading.Thread(target=survivor_stream), threading.Thread(target=queued_behind)
    t.start()
    actor = ray.get_actor(before[victim]["info"]["actor_name"], namespace="serve")
    got = 0
    with pytest.raises(openai.APIError, match="replica r0 died"):
        with client.chat.completions.with_streaming_response.create(model=MODEL, messages=by[victim][0],
                                                                    **long) as r:
            assert r.headers["x-mawforge-replica"] == victim
            for _ in r.parse():
                got += 1
                if got == 1:
                    q.start()
                    time.sleep(0.3)
                if got == 5:
                    ray.kill(actor, no_restart=False)          # the replica's process dies mid-stream
    moved = by[victim][1]                                     # while it is down, its conversations go to
    assert ask(client, moved, max_tokens=2, temperature=0)[0] == survivor    # the other replica
    assert 5 <= got < 1800
    t.join(120)
    q.join(120)
    assert not t.is_alive() and other == {"replica": survivor, "chunks": 1800, "queued": (503, "replica_unavailable")}
    deadline = time.monotonic() + 120                          # Ray Serve restarts it: a new process
    while not ((h := health(url))[victim]["up"] and h[victim]["info"]["pid"] != before[victim]["info"]["pid"]) \
            and time.monotonic() < deadline:
        time.sleep(0.5)
    assert h[victim]["up"] and h[victim]["info"]["pid"] != before[victim]["info"]["pid"]
    assert ask(client, by[victim][0], max_tokens=2, temperature=0)[0] == victim   # it serves again
    assert ask(client, moved, max_tokens=2, temperature=0)[0] == survivor        # the moved one stayed


def test_a_replica_whose_plan_does_not_fit_fails_clearly_and_a_cluster_without_room_too(cluster):
    from mawforge.serve.replicas import deploy

    a = serve_args(cluster.pack, 0, "--memory-budget-gib", "0.05", "--replica-cpus", "0")   # the CPUs are taken
    with pytest.raises(BudgetRejected, match=r"replica r\d on \S+: plan rejected: "):
        deploy(a, name="tight", route_prefix="/tight")
    with pytest.raises(MawError, match="the Ray cluster has room for"):
        deploy(serve_args(cluster.pack, 0, "--replicas", "9", "--replica-cpus", "1"), name="big",
               route_prefix="/big")
