"""The OpenAI API as clients read it: every response and stream chunk parsed into the `openai`
package's own pydantic types (strict, no stray field), the sampling fields (logprobs against
torch.log_softmax of the runtime's logits, n, seed, echo, list prompts, logit_bias, penalties)
through the server, OpenAI's 400s, /metrics behind the key, and docs/openai-api.md's table
checked row by row against the server."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import List, Literal, Optional

import httpx
import pydantic
import pytest
import torch
from openai.types import Completion, CompletionChoice, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.shared import ErrorObject

from mawforge.engine.generate import generate
from mawforge.engine.runtime import Runtime, RuntimeOptions
from mawforge.engine.sampling import SamplingParams
from mawforge.pack.packer import pack
from mawforge.plan import Budget
from mawforge.serve import limits
from mawforge.serve.app import ServerThread, build_app

CONTEXT, MODEL = 1024, "tiny-qwen3"
CHAT = [{"role": "user", "content": "Tell me about expert caches."}]
DOC = Path(__file__).resolve().parents[1] / "docs" / "openai-api.md"
# fields outside OpenAI's types that the server sends on purpose
EXTRAS = {"ChatCompletion": {"telemetry"}, "Completion": {"telemetry"}, "CompletionChunk": {"telemetry"},
          "ChatCompletionChunk": {"telemetry"},
          "ChatCompletionMessage": {"reasoning_content"}, "ChoiceDelta": {"reasoning_content"},
          "Model": {"pack_digest", "context", "architecture", "chat_template", "tool_call_format"}}


class StreamedChoice(CompletionChoice):
    """OpenAI streams legacy completions as Completion objects whose choices have finish_reason
    null until the last; its Completion type, written for whole answers, does not allow that
    (the client parses chunks without validating). The same type, with that one field optional."""
    finish_reason: Optional[Literal["stop", "length", "content_filter"]]


class CompletionChunk(Completion):
    choices: List[StreamedChoice]


@pytest.fixture(scope="module")
def rt(fixtures_root, tmp_path_factory):
    out = tmp_path_factory.mktemp("openai") / "pack"
    pack(fixtures_root["qwen3_moe"]["gguf"]["Q8_0"], out, progress=False)
    threads = torch.get_num_threads()
    runtime = Runtime(out, RuntimeOptions(context=CONTEXT, budget=Budget(2 << 30, "test"), expert_cache_percent=100,
                                          threads=1))
    yield runtime
    runtime.close()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def url(rt):
    with ServerThread(build_app(rt, MODEL, max_tokens_default=6, dashboard=False)) as s:
        yield s.url


def strict(cls, obj: dict):
    """obj as OpenAI's type, strictly; then no field the type does not know, beyond EXTRAS."""
    m = cls.model_validate(obj, strict=True)

    def walk(x):
        if isinstance(x, pydantic.BaseModel):
            extra = set(x.model_extra or {}) - EXTRAS.get(type(x).__name__, set())
            assert not extra, f"{type(x).__name__} has fields OpenAI does not define: {extra}"
            for v in dict(x).values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
    walk(m)
    return m


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=120)


def sse(url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def answer(url: str, kind: str, stream: bool = False, **body):
    """A whole answer validated as Completion/ChatCompletion, or its chunks each validated."""
    path, cls = (("/v1/chat/completions", ChatCompletionChunk if stream else ChatCompletion) if kind == "chat"
                 else ("/v1/completions", CompletionChunk if stream else Completion))
    body = {"model": MODEL, **({"messages": CHAT} if kind == "chat" else {"prompt": "The cache holds"}), **body}
    if stream:
        return [strict(cls, c) for c in sse(url, path, body)]
    r = post(url, path, body)
    assert r.status_code == 200, r.text
    return strict(cls, r.json())


# ---- every response validates ---------------------------------------------------------------

BOTH = [{}, {"n": 2, "seed": 1, "temperature": 1.0}, {"stop": "e", "max_tokens": 12}]
CASES = ([("chat", x) for x in BOTH + [{"logprobs": True, "top_logprobs": 2}, {"reasoning_effort": "low"}]]
         + [("completion", x) for x in BOTH + [{"logprobs": 2}, {"echo": True}, {"prompt": ["one", [5, 6]], "n": 2},
                                               {"logprobs": 0, "n": 2}]])


@pytest.mark.parametrize("kind,extra", CASES, ids=[f"{k}-{'-'.join(x) or 'plain'}" for k, x in CASES])
@pytest.mark.parametrize("stream", [False, True, "usage"])
def test_every_response_and_chunk_parses_as_openais_types(url, kind, extra, stream):
    usage = {"stream_options": {"include_usage": True}} if stream == "usage" else {}
    got = answer(url, kind, bool(stream), **{"max_tokens": 4, **extra, **usage})
    n = extra.get("n", 1) * len(extra.get("prompt", [0]))
    if not stream:
        assert [c.index for c in got.choices] == list(range(n))
        assert got.usage.completion_tokens == got.model_extra["telemetry"]["completion_tokens"]
        return
    assert {c.choices[0].index for c in got if c.choices} == set(range(n))
    assert sum(1 for c in got if c.choices and c.choices[0].finish_reason) == n
    assert "telemetry" in got[-1].model_extra and all("telemetry" not in c.model_extra for c in got[:-1])
    assert (got[-1].usage is not None) == bool(usage)


def test_models_errors_and_tool_calls_parse_as_openais_types(url, rt, tmp_path):
    listing = httpx.get(url + "/v1/models").json()
    assert listing["object"] == "list" and [strict(Model, m).id for m in listing["data"]] == [MODEL]
    assert strict(Model, httpx.get(f"{url}/v1/models/{MODEL}").json()).id == MODEL
    for r in (httpx.get(url + "/v1/models/other"), post(url, "/v1/completions", {"prompt": "x", "n": "2"}),
              post(url, "/v1/embeddings", {})):
        assert r.status_code in (400, 404) and set(r.json()) == {"error"}
        strict(ErrorObject, r.json()["error"])
    from mawforge.fixtures.sdist_templates import SdistMissing, template_dir
    try:
        source = (template_dir() / "Qwen-Qwen3-0.6B.jinja").read_text()
    except SdistMissing as e:
        pytest.skip(f"llama-cpp-python sdist not available (its Qwen3 tool-call template): {e}")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    with ServerThread(build_app(rt, MODEL, chat_template=source, allow_forced_output=True, dashboard=False)) as s:
        body = {"tools": tools, "forced_output": call, "max_tokens": 60,
                "chat_template_kwargs": {"enable_thinking": False}}
        whole = answer(s.url, "chat", **body)
        assert whole.choices[0].finish_reason == "tool_calls"
        assert whole.choices[0].message.tool_calls[0].function.name == "get_weather"
        chunks = answer(s.url, "chat", stream=True, **body)
        assert any(c.choices and c.choices[0].delta.tool_calls for c in chunks)


# ---- the sampling fields through the server ------------------------------------------------

def replay(rt, prompt: list[int], tokens: list[int]) -> list[torch.Tensor]:
    rt.reset()
    out = [rt.forward(prompt)[-1].float()]
    out += [rt.forward([t], kind="decode")[-1].float() for t in tokens[:-1]]
    return [torch.log_softmax(x, dim=-1) for x in out]


def test_chat_logprobs_are_log_softmax_of_the_runtime_logits(url, rt):
    whole = answer(url, "chat", max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    content = whole.choices[0].logprobs.content
    ids = rt.tokenizer.encode(rt.tokenizer.chat.render(CHAT, add_generation_prompt=True))
    tokens = [e.token for e in generate(rt, ids, SamplingParams(max_tokens=6))]     # the server is idle
    assert [bytes(c.bytes) for c in content] == [rt.tokenizer.token_bytes(t) for t in tokens]
    for c, t, ref in zip(content, tokens, replay(rt, ids, tokens)):
        assert abs(c.logprob - float(ref[t])) < 1e-6
        vals, idx = torch.topk(ref, 3)
        assert [bytes(x.bytes) for x in c.top_logprobs] == [rt.tokenizer.token_bytes(i) for i in idx.tolist()]
        assert max(abs(x.logprob - float(v)) for x, v in zip(c.top_logprobs, vals)) < 1e-6
    streamed = [c.choices[0].logprobs.content for c in answer(url, "chat", True, max_tokens=6, temperature=0,
                                                              logprobs=True, top_logprobs=3)
                if c.choices and c.choices[0].logprobs]
    assert [x for lp in streamed for x in lp] == content


def test_completion_logprobs_tokens_and_offsets_cover_the_text(url):
    c = answer(url, "completion", max_tokens=6, temperature=0, logprobs=2).choices[0]
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert all(len(t) == 2 and max(t.values()) >= v - 1e-6 for t, v in zip(lp.top_logprobs, lp.token_logprobs))
    assert all(v <= 0 for v in lp.token_logprobs)
    chunks = [c.choices[0].logprobs for c in answer(url, "completion", True, max_tokens=6, temperature=0, logprobs=2)
              if c.choices and c.choices[0].logprobs]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for c in chunks for x in getattr(c, key)] == getattr(lp, key), key


def test_n_choices_equal_separately_seeded_requests_and_usage_counts_the_prompt_once(url):
    ask = dict(max_tokens=5, temperature=1.3, seed=42)
    many = answer(url, "completion", n=3, **ask)
    alone = [answer(url, "completion", **{**ask, "seed": SamplingParams(seed=42).for_choice(i).seed})
             for i in range(3)]
    assert [c.text for c in many.choices] == [a.choices[0].text for a in alone]
    assert many.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert many.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    streamed = answer(url, "completion", True, n=3, **ask)
    texts = ["".join(c.choices[0].text for c in streamed if c.choices and c.choices[0].index == i) for i in range(3)]
    assert texts == [c.text for c in many.choices]
    chat = answer(url, "chat", n=2, **ask)
    assert len({c.message.content for c in chat.choices}) >= 1 and chat.choices[1].index == 1


def test_list_prompts_and_echo(url):
    prompts = ["The cache holds", "Experts are"]
    both = answer(url, "completion", prompt=prompts, echo=True, max_tokens=4, temperature=0)
    for p, c in zip(prompts, both.choices):
        one = answer(url, "completion", prompt=p, max_tokens=4, temperature=0)
        assert c.text == p + one.choices[0].text
    streamed = answer(url, "completion", True, prompt=prompts, echo=True, max_tokens=4, temperature=0)
    for i, c in enumerate(both.choices):
        assert "".join(x.choices[0].text for x in streamed if x.choices and x.choices[0].index == i) == c.text


def test_bias_and_penalties_reach_the_engine(url, rt):
    ids = rt.tokenizer.encode("The cache holds")
    for fields in ({"frequency_penalty": 1.5, "presence_penalty": 0.5}, {"logit_bias": {"17": 100}}):
        got = answer(url, "completion", max_tokens=8, temperature=0, ignore_eos=True, **fields).choices[0].text
        params = SamplingParams(max_tokens=8, ignore_eos=True, presence_penalty=fields.get("presence_penalty", 0),
                                frequency_penalty=fields.get("frequency_penalty", 0),
                                logit_bias=tuple((int(k), float(v)) for k, v in fields.get("logit_bias", {}).items()))
        assert got == "".join(e.text for e in generate(rt, ids, params))


# ---- OpenAI's 400s --------------------------------------------------------------------------

@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"model": None, "messages": CHAT}, "model"),
    ("/v1/completions", {"model": 7, "prompt": "x"}, "model"),
    ("/v1/chat/completions", {"messages": CHAT, "n": "2"}, "n"),
    ("/v1/chat/completions", {"messages": CHAT, "user": 5}, "user"),
    ("/v1/chat/completions", {"messages": CHAT, "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "x", "logprobs": True}, "logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": 3}, "logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "max_token": 3}, "max_token"),
    ("/v1/completions", {"prompt": "x", "messages": CHAT}, "messages"),
    ("/v1/chat/completions", {"messages": CHAT, "echo": True}, "echo"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": 6}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"1000000": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "x", "n": 16, "max_tokens": 100}, "n"),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, "best_of"),
    ("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 1}, "echo"),
])
def test_bad_fields_get_openais_400_naming_the_field(url, path, body, param):
    r = post(url, path, body)
    assert r.status_code == 400, r.text
    err = strict(ErrorObject, r.json()["error"])
    assert err.param == param and err.type == "invalid_request_error" and err.message


def test_metrics_need_the_key_and_health_does_not(rt):
    with ServerThread(build_app(rt, MODEL, api_key="sesame", dashboard=False)) as s:
        assert httpx.get(s.url + "/health").status_code == 200
        r = httpx.get(s.url + "/metrics")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        ok = httpx.get(s.url + "/metrics", headers={"Authorization": "Bearer sesame"})
        assert ok.status_code == 200 and ok.text.startswith("# HELP mawforge_")


# ---- docs/openai-api.md, row by row --------------------------------------------------------

def table(heading: str) -> list[list[str]]:
    """The rows of the markdown table under `## heading`, cells stripped of backticks."""
    text = DOC.read_text().split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip().strip("`") for c in ln.strip().strip("|").split("|")] for ln in text.splitlines()
            if ln.startswith("|")]
    return rows[2:]


# The table's server: a ChatML template that renders tools and honours enable_thinking (the
# fixture's own ignores both), with the forced_output hook on, so every row can show its effect.
TABLE_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools: {{ tools | tojson }}. Call one as <tool_call>{json}</tool_call>"
    "<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{%- endif %}{%- endif %}")


def examples(rt) -> dict:
    """Per field: (value, contrast). The request with the value is compared with the request
    with `contrast` alone (None: neither), both over a greedy 6-token base. A supported field
    must change the answer; an ignored one must leave it as it was; a refused one must get a 400
    naming it. `t` is a token the bias forces (its text is the stop string)."""
    t = next(i for i in range(17, 300) if rt.tokenizer.decode([i]).strip().isalnum() and i not in rt.tokenizer.eos_ids)
    eos, force = min(rt.tokenizer.eos_ids), {"logit_bias": {str(t): 100}}
    hot = {"temperature": 1.5, "seed": 3}
    tool = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    return {
        "model": (MODEL, {"model": "another-model"}),
        "messages": ([{"role": "user", "content": "Name a colour."}], None),
        "prompt": ("Name a colour.", None), "max_tokens": (2, None), "max_completion_tokens": (2, None),
        "temperature": (1.5, {"seed": 3}), "top_p": (0.1, hot), "n": (2, None), "stream": (True, None),
        "stream_options": ({"include_usage": True}, {"stream": True}), "stop": (rt.tokenizer.decode([t]), force),
        "seed": (4, hot), "logit_bias": (force["logit_bias"], None),
        # greedy never repeats within 6 tokens here: negative penalties over 32 make it repeat
        "presence_penalty": (-2.0, {"max_tokens": 32}), "frequency_penalty": (-2.0, {"max_tokens": 32}),
        "logprobs": (True, None), ("logprobs", "completion"): (2, None), "top_logprobs": (2, {"logprobs": True}),
        "echo": (True, None), "best_of": (3, None), "suffix": ("end", None), "user": ("u1", None),
        "tools": (tool, None), "tool_choice": ("none", {"tools": tool}), "parallel_tool_calls": (False, None),
        "functions": ([{"name": "f"}], None), "function_call": ("auto", None),
        "response_format": ({"type": "json_object"}, None), "reasoning_effort": ("none", None),
        "reasoning": ({"effort": "low"}, None), "metadata": ({"k": "v"}, None), "store": (True, None),
        "service_tier": ("auto", None), "modalities": (["text"], None),
        "audio": ({"voice": "alloy", "format": "mp3"}, None), "prediction": ({"type": "content", "content": "x"}, None),
        "web_search_options": ({"search_context_size": "low"}, None), "verbosity": ("low", None),
        "prompt_cache_key": ("k", None), "prompt_cache_options": ({"mode": "implicit"}, None),
        "prompt_cache_retention": ("in_memory", None), "safety_identifier": ("s", None),
        "moderation": ({"model": "omni-moderation-latest"}, None),
        "top_k": (1, hot), "min_p": (0.9, hot), "ignore_eos": (True, {"logit_bias": {str(eos): 100}}),
        "stop_token_ids": ([t], force), "speculative": ("ngram", None), "forced_output": ("hello", None),
        "chat_template_kwargs": ({"enable_thinking": False}, None),
        "reasoning_format": ("none", {"forced_output": "<think>a</think>b"}),
    }


def _outcome(url: str, kind: str, body: dict):
    """What a client sees: the status, then the error's param, or the choices, the usage and the
    speculative mode that ran (speculation changes no token: telemetry shows it)."""
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    base = {"model": MODEL, "max_tokens": 6, "temperature": 0,
            **({"messages": CHAT} if kind == "chat" else {"prompt": "The cache holds"})}
    body = {**base, **body}
    if body.get("stream"):
        with httpx.stream("POST", url + path, json=body, timeout=120) as r:
            data = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
        return r.status_code, [(c.get("choices"), {k: v for k, v in (c.get("usage") or {}).items()
                                                    if k != "prompt_tokens_details"}) for c in data]
    r = post(url, path, body)
    j = r.json()
    if r.status_code != 200:
        return r.status_code, j["error"]["param"]
    # what the prompt cache reused depends on the requests before, not on the field under test
    use = {k: v for k, v in j["usage"].items() if k != "prompt_tokens_details"}
    return r.status_code, (j["choices"], use, j["telemetry"]["speculative"]["mode"])


def test_the_field_table_is_true(rt):
    rows, ex = table("Request fields"), examples(rt)
    kinds = {"chat": "chat", "completions": "completion"}
    seen, bases = set(), {}
    with ServerThread(build_app(rt, MODEL, chat_template=TABLE_TEMPLATE, allow_forced_output=True,
                                dashboard=False)) as s:
        for field, endpoints, status, why in rows:
            assert status in ("supported", "ignored", "refused") and (why or status == "supported"), field
            for ep in re.split(r",\s*", endpoints):
                kind = kinds[ep]
                seen.add((field, kind))
                value, contrast = ex.get((field, kind), ex[field])
                contrast = contrast or {}
                code, got = _outcome(s.url, kind, {**contrast, field: value})
                if status == "refused":
                    assert (code, got) == (400, field), (field, kind, code, got)
                    continue
                assert code == 200, (field, kind, code, got)
                key = (kind, json.dumps(contrast, sort_keys=True))
                if key not in bases:                  # greedy or seeded: the same request, the same answer
                    bases[key] = _outcome(s.url, kind, contrast)[1]
                base = bases[key]
                assert (got != base) == (status == "supported"), (field, kind, status, got, base)
    known = {(f, k) for f, (eps, _) in limits.FIELDS.items() for k in eps}
    assert seen == known, f"rows missing: {sorted(known - seen)}; rows for unknown fields: {sorted(seen - known)}"


def test_every_field_of_openais_client_has_a_row():
    import typing

    from openai.types import completion_create_params as comp
    from openai.types.chat import completion_create_params as chat
    rows = {(r[0], e) for r in table("Request fields") for e in re.split(r",\s*", r[1])}
    for kind, mod in (("chat", chat), ("completions", comp)):
        want = set(typing.get_type_hints(mod.CompletionCreateParamsBase)) | {"stream"}
        assert not {f for f in want if (f, kind) not in rows}, kind


def test_the_endpoint_table_is_true(url):
    for endpoint, status, why in table("Endpoints"):
        method, path = endpoint.split(" ", 1)
        r = httpx.request(method, url + path.replace("{id}", MODEL), json={"prompt": "x", "max_tokens": 1,
                                                                              "messages": CHAT, "input": "x"}
                          if method == "POST" else None, timeout=120)
        assert why and status in ("supported", "not served"), endpoint
        assert (r.status_code != 404) == (status == "supported"), (endpoint, r.status_code)
