"""benchmarks/conversation.py's workloads and its client-side measurement, on the shipped demo
model: every turn's prompt extends the previous one (what a prefix cache can reuse), the ids the
benchmark feeds llama.cpp are the ones `mawforge serve` counts for the same chat request, and a
streamed turn read through the official openai client gives TTFT, usage and telemetry."""
from __future__ import annotations


import openai
import pytest

from helpers import bench_module
from mawforge.demo import demo_gguf
from mawforge.engine.runtime import Runtime, RuntimeOptions
from mawforge.pack.packer import pack
from mawforge.serve.app import ServerThread, build_app



@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    conv = bench_module("conversation")
    root = tmp_path_factory.mktemp("conv")
    pk = root / "pack"
    pack(demo_gguf("Q4_K_M"), pk, progress=False)
    render, tok = conv.renderer(pk, conv.FALLBACK_TEMPLATE)
    return conv, pk, render, tok


def test_workloads_are_seeded_and_each_turn_extends_the_last(bench):
    conv, _, render, tok = bench
    chat = conv.chat_workload(0.1, 0)
    assert chat == conv.chat_workload(0.1, 0) and chat != conv.chat_workload(0.1, 1)
    assert [len(t) for t in chat["turns"]] == [2, 4, 6] and chat["tools"] is None
    assert all(len(m["content"].split()) == 20 for m in chat["turns"][-1] if m["role"] == "user")
    agent = conv.agent_workload(render, tok, 0.5, 0)
    assert len(agent["turns"]) == 10 and [t["function"]["name"] for t in agent["tools"]][0] == "read_file"
    last = agent["turns"][-1]
    assert sum(m["role"] == "tool" for m in last) == 8 and sum(m["role"] == "user" for m in last) == 2
    ids = [render(m, agent["tools"]) for m in agent["turns"]]
    assert len(ids[0]) >= 750 and "<tools>" in tok.decode(ids[0])
    for prev, cur in zip(ids, ids[1:]):
        assert cur[:len(prev)] == prev and len(cur) > len(prev)
    assert 150 <= len(tok.encode(conv.text_of_tokens(tok, conv.random.Random(3), 150), add_special=False)) <= 155


def test_client_measurement_matches_the_server(bench):
    conv, pk, render, _tok = bench
    engines = conv.E
    agent = conv.agent_workload(render, _tok, 0.1, 0)
    rt = Runtime(pk, RuntimeOptions(context=2048, expert_cache_percent=100))
    try:
        app = build_app(rt, engines.MODEL_ID, chat_template=conv.FALLBACK_TEMPLATE.read_text(), dashboard=False)
        with ServerThread(app) as s:
            client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
            for messages in agent["turns"][:2]:
                t = engines.chat_turn(client, messages, agent["tools"], 4)
                assert t["prompt_tokens"] == len(render(messages, agent["tools"]))
                assert t["completion_tokens"] == 4 and t["ttft_s"] > 0 and t["decode_tok_s"] > 0
                assert t["cached_tokens"] is None or 0 <= t["cached_tokens"] < t["prompt_tokens"]
                assert t["telemetry"]["prefill_needed_bytes"] >= 0 and t["telemetry"]["ttft_s"] <= t["ttft_s"]
    finally:
        rt.close()
