"""`mawforge serve` with the prompt cache, through the official openai client: a three-turn chat
reports growing `usage.prompt_tokens_details.cached_tokens` and says what the same server says
with the cache off; concurrent requests sharing a prefix answer as alone; /metrics and the
dashboard count hits; a prompt longer than the context is a 400 before any work."""
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from mawforge.engine.runtime import Runtime, RuntimeOptions
from mawforge.pack.packer import pack
from mawforge.serve.app import ServerThread, build_app

MODEL = "tiny-qwen3"
SYSTEM = {"role": "system", "content": "You are a terse assistant who knows about expert caches, "
                                       "disks, memory budgets and the prefill of long prompts. " * 3}
OPTS = dict(context=512, prefill_chunk=16, threads=1, expert_cache_percent=100)


@pytest.fixture(scope="module")
def servers(fixtures_root, tmp_path_factory):
    out = tmp_path_factory.mktemp("serve_pc") / "pack"
    pack(fixtures_root["qwen3_moe"]["gguf"]["Q8_0"], out, progress=False)
    threads = torch.get_num_threads()
    rts = {"on": Runtime(out, RuntimeOptions(**OPTS)), "off": Runtime(out, RuntimeOptions(**OPTS, prompt_cache_gib=0))}
    with ServerThread(build_app(rts["on"], MODEL, max_tokens_default=8)) as on, \
            ServerThread(build_app(rts["off"], MODEL, max_tokens_default=8)) as off:
        yield {"on": on, "off": off, "rt": rts["on"]}
    for rt in rts.values():
        rt.close()
    torch.set_num_threads(threads)


def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def ask(server, messages, **kw):
    return client(server).chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=8, **kw)


def test_three_turns_report_growing_cached_tokens_and_the_same_text(servers):
    messages, cached = [SYSTEM], []
    for question in ("What does an expert cache hold?", "And when the disk is slow?", "Say it once more, briefly."):
        messages.append({"role": "user", "content": question})
        r, cold = ask(servers["on"], messages), ask(servers["off"], messages)
        assert r.choices[0].message.content == cold.choices[0].message.content
        assert cold.usage.prompt_tokens_details.cached_tokens == 0
        details = r.usage.prompt_tokens_details           # the openai package's own type parsed it
        assert isinstance(details, openai.types.completion_usage.PromptTokensDetails)
        assert details.cached_tokens == r.model_extra["telemetry"]["cached_tokens"] < r.usage.prompt_tokens
        cached.append(details.cached_tokens)
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
    assert 0 == cached[0] < cached[1] < cached[2]
    # streamed, the usage chunk carries it too; and a completion reports it as well
    chunks = list(ask(servers["on"], messages[:-1], stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == chunks[-1].usage.prompt_tokens
    c = client(servers["on"]).completions.create(model=MODEL, prompt="The cache holds", max_tokens=4, temperature=0)
    again = client(servers["on"]).completions.create(model=MODEL, prompt="The cache holds", max_tokens=4, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens
    assert again.choices[0].text == c.choices[0].text
    metrics = httpx.get(servers["on"].url + "/metrics").text
    value = lambda name: float(next(line.split()[-1] for line in metrics.splitlines() if line.startswith(name + " ")))
    assert value("mawforge_prompt_cache_hits_total") >= 3 and value("mawforge_cached_tokens_total") >= sum(cached)
    assert value("mawforge_prompt_cache_held_bytes") > 0 and value("mawforge_prompt_cache_entries") >= 1
    rows = httpx.get(servers["on"].url + "/dashboard/api/requests").json()
    assert any(row["cached_tokens"] > 0 for row in (rows if isinstance(rows, list) else rows["requests"]))


def test_concurrent_requests_sharing_a_prefix_answer_as_alone(servers):
    prompts = [[SYSTEM, {"role": "user", "content": f"Question {i}: how many experts fit in {i} GiB?"}]
               for i in range(4)]
    alone = [ask(servers["off"], m).choices[0].message.content for m in prompts]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda m: ask(servers["on"], m), prompts))
    assert [r.choices[0].message.content for r in together] == alone
    assert sum(r.usage.prompt_tokens_details.cached_tokens > 0 for r in together) >= 3


def test_a_prompt_longer_than_the_context_is_a_400_before_any_work(servers):
    rt = servers["rt"]
    before = rt.prompt_cache.report()["lookups"], rt.cache.stats()["misses"] + rt.cache.stats()["hits"]
    with pytest.raises(openai.BadRequestError) as e:
        ask(servers["on"], [{"role": "user", "content": "cache " * 2000}])
    assert e.value.code == "context_length_exceeded"
    assert (rt.prompt_cache.report()["lookups"], rt.cache.stats()["misses"] + rt.cache.stats()["hits"]) == before
