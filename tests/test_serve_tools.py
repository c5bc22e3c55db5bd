"""Tool calls and reasoning through the whole server: the official openai client, the real chat
templates llama.cpp ships (attached with --chat-template-file's build_app twin), and the tiny
qwen3_moe fixture model. A random model writes no tool call, so each request names its output
with the documented testing hook `forced_output` (server option --allow-forced-output): the
model still runs every step, the template, the parser and the API shapes are the real ones.
Prompts are checked against transformers' apply_chat_template of the same conversation."""
import copy
import json

import httpx
import openai
import pytest
import torch

from mawforge.engine.runtime import Runtime, RuntimeOptions
from mawforge.fixtures.build import build_fixtures
from mawforge.fixtures.sdist_templates import SdistMissing, template_dir
from mawforge.pack.packer import pack
from mawforge.plan import Budget
from mawforge.serve.app import ServerThread, build_app
from mawforge.front.chatreq import ChatDefaults

transformers = pytest.importorskip("transformers")
try:
    TEMPLATES = template_dir()
except SdistMissing as e:
    pytest.skip(f"llama-cpp-python sdist not available: {e}", allow_module_level=True)

MODEL = "tiny-tools"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "search", "description": "Web search",
                                      "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]
ASK = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Weather in Paris?"}]
Q = '<|"|>'
# template -> (what the model writes to call get_weather(city=Paris), the reasoning it holds)
FAMILIES = {
    "Qwen-Qwen3-0.6B": ('<think>\nUser wants weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
                        '"arguments": {"city": "Paris"}}\n</tool_call>', "User wants weather."),
    "Qwen3.5-4B": ("User wants weather.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
                   "</parameter>\n</function>\n</tool_call>", "User wants weather."),
    "deepseek-ai-DeepSeek-V3.1": ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
                                  '{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>', None),
    "openai-gpt-oss-120b": ("<|channel|>analysis<|message|>User wants weather.<|end|><|start|>assistant<|channel|>"
                            'commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>',
                            "User wants weather."),
    "google-gemma-4-31B-it": (f"<|tool_call>call:get_weather{{city:{Q}Paris{Q}}}<tool_call|>", None),
    "GLM-4.6": ("<think>User wants weather.</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
                "<arg_value>Paris</arg_value>\n</tool_call>", "User wants weather."),
    "meta-llama-Llama-3.1-8B-Instruct": ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None),
    "Mistral-Small-3.2-24B-Instruct-2506": ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', None),
}

# what the model writes before its answer where the prompt leaves it inside a reasoning block
ANSWERS = {"Qwen3.5-4B": "The tool answered.\n</think>\n\n", "openai-gpt-oss-120b": "<|channel|>final<|message|>"}


@pytest.fixture(scope="module")
def rt(tmp_path_factory):
    root = tmp_path_factory.mktemp("tools")
    built = build_fixtures(root / "fx", archs=("qwen3_moe",), ftypes=("Q8_0",))
    pack(built["qwen3_moe"]["gguf"]["Q8_0"], root / "pack", progress=False)
    threads = torch.get_num_threads()
    runtime = Runtime(root / "pack", RuntimeOptions(context=4096, budget=Budget(2 << 30, "test"),
                                                    expert_cache_percent=50, threads=1))
    yield runtime
    runtime.close()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def hf(rt):
    """Only its template renderer is used (prompts are tokenized by the pack's tokenizer)."""
    from transformers import PreTrainedTokenizerFast

    from mawforge.fixtures.tokenizer import build_tokenizer
    chat = rt.tokenizer.chat
    return PreTrainedTokenizerFast(tokenizer_object=build_tokenizer("gpt2").tokenizer, bos_token=chat.bos,
                                   eos_token=chat.eos)


class Served:
    """One server per template, all on the same runtime."""

    def __init__(self, rt, stem: str, **kw):
        self.source = (TEMPLATES / f"{stem}.jinja").read_text()
        self.thread = ServerThread(build_app(rt, MODEL, max_tokens_default=200, chat_template=self.source,
                                             allow_forced_output=True, **kw))

    def __enter__(self):
        self.thread.__enter__()
        self.url = self.thread.url
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0)
        return self

    def __exit__(self, *exc):
        self.thread.__exit__(*exc)

    def ask(self, messages, forced: str, **kw):
        extra = {"forced_output": forced, **kw.pop("extra_body", {})}
        return self.client.chat.completions.create(model=MODEL, messages=messages, extra_body=extra, **kw)


def hf_prompt_tokens(rt, hf, source: str, messages, tools=None, suffix: str = "", **kw) -> int:
    """What transformers renders for the conversation (arguments as objects, as its docs say)."""
    msgs = copy.deepcopy(messages)
    for m in msgs:
        for c in m.get("tool_calls") or ():
            c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    hf.chat_template = source
    text = hf.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True, **kw)
    return len(rt.tokenizer.encode(text + suffix))


@pytest.mark.parametrize("stem", list(FAMILIES))
def test_tool_call_round_trip(rt, hf, stem):
    forced, reasoning = FAMILIES[stem]
    with Served(rt, stem) as s:
        r = s.ask(ASK, forced, tools=TOOLS)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id and call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris"}
        assert getattr(choice.message, "reasoning_content", None) == reasoning
        assert not choice.message.content
        assert r.usage.prompt_tokens == hf_prompt_tokens(rt, hf, s.source, ASK, TOOLS)

        history = ASK + [{"role": "assistant", "content": "", "tool_calls": [call.model_dump()]},
                         {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]
        answer = ANSWERS.get(stem, "") + "It is 21 degrees."
        r2 = s.ask(history, answer, tools=TOOLS)
        assert r2.choices[0].message.content == "It is 21 degrees."
        assert r2.choices[0].finish_reason == "stop" and not r2.choices[0].message.tool_calls
        assert r2.usage.prompt_tokens == hf_prompt_tokens(rt, hf, s.source, history, TOOLS)


def _stream(s: Served, messages, forced, **kw):
    chunks = list(s.ask(messages, forced, stream=True, **kw))
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]
    return chunks, reasoning, content, calls


@pytest.mark.parametrize("stem,forced", [
    ("Qwen3.5-4B", "Two and two make four.\n</think>\n\nThe answer is 4."),
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "Two and two make four.\n</think>\n\nThe answer is 4."),
    ("google-gemma-4-31B-it", "<|channel>thought\nTwo and two make four.<channel|>The answer is 4."),
    ("openai-gpt-oss-120b", "<|channel|>analysis<|message|>Two and two make four.<|end|><|start|>assistant"
                            "<|channel|>final<|message|>The answer is 4."),
])
def test_streamed_reasoning_answer(rt, stem, forced):
    think = {"extra_body": {"chat_template_kwargs": {"enable_thinking": True}}}   # R1-Distill's default is off
    with Served(rt, stem) as s:
        chunks, reasoning, content, calls = _stream(s, [{"role": "user", "content": "2+2?"}], forced, **think)
        whole = s.ask([{"role": "user", "content": "2+2?"}], forced, **think).choices[0]
    assert reasoning == "Two and two make four." and content == "The answer is 4." and calls == []
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert whole.message.content == content and whole.message.reasoning_content == reasoning


def test_streamed_tool_call_deltas_arrive_as_openai_sends_them(rt):
    forced = FAMILIES["Qwen-Qwen3-0.6B"][0]
    with Served(rt, "Qwen-Qwen3-0.6B") as s:
        chunks, reasoning, content, calls = _stream(s, ASK, forced, tools=TOOLS)
    head, rest = calls[0], calls[1:]
    assert head.index == 0 and head.id and head.type == "function" and head.function.name == "get_weather"
    assert head.function.arguments == "" and rest
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in rest)
    assert json.loads("".join(d.function.arguments for d in rest)) == {"city": "Paris"}
    assert reasoning == "User wants weather." and content == ""
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_malformed_tool_call_comes_back_as_text(rt):
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>'
    with Served(rt, "Qwen-Qwen3-0.6B") as s:
        r = s.ask(ASK, bad, tools=TOOLS)
        _, _, streamed, calls = _stream(s, ASK, bad, tools=TOOLS)
    assert r.choices[0].message.content == bad == streamed and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop" and calls == []


def test_tool_choice_none_required_and_named_shape_the_prompt(rt, hf):
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    with Served(rt, "Qwen-Qwen3-0.6B") as s:
        none = s.ask(ASK, "<tool_call>\n" + call, tools=TOOLS, tool_choice="none")
        assert none.choices[0].message.content == "<tool_call>\n" + call and not none.choices[0].message.tool_calls
        assert none.usage.prompt_tokens == hf_prompt_tokens(rt, hf, s.source, ASK)

        req = s.ask(ASK, call, tools=TOOLS, tool_choice="required")
        assert req.choices[0].message.tool_calls[0].function.name == "get_weather"
        assert req.usage.prompt_tokens == hf_prompt_tokens(rt, hf, s.source, ASK, TOOLS, suffix="<tool_call>\n")

        named = s.ask(ASK, '{"city": "Paris"}}\n</tool_call>', tools=TOOLS,
                      tool_choice={"type": "function", "function": {"name": "get_weather"}})
        tc = named.choices[0].message.tool_calls[0]
        assert (tc.function.name, json.loads(tc.function.arguments)) == ("get_weather", {"city": "Paris"})
        assert named.usage.prompt_tokens == hf_prompt_tokens(
            rt, hf, s.source, ASK, TOOLS[:1], suffix='<tool_call>\n{"name": "get_weather", "arguments": ')
    with Served(rt, "Qwen3.5-4B") as s:      # the prompt ends inside <think>: the prefill closes it first
        r = s.ask(ASK, "get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
                  tools=TOOLS, tool_choice="required")
        assert r.choices[0].message.tool_calls[0].function.name == "get_weather"
        assert getattr(r.choices[0].message, "reasoning_content", None) is None
        assert r.usage.prompt_tokens == hf_prompt_tokens(rt, hf, s.source, ASK, TOOLS,
                                                         suffix="</think>\n\n<tool_call>\n<function=")


def test_reasoning_flags_and_template_kwargs(rt, hf):
    q = [{"role": "user", "content": "2+2?"}]
    with Served(rt, "Qwen3.5-4B", chat_defaults=ChatDefaults(reasoning="off")) as s:
        off = s.ask(q, "Four.")
        assert off.choices[0].message.content == "Four."
        assert getattr(off.choices[0].message, "reasoning_content", None) is None
        assert off.usage.prompt_tokens == hf_prompt_tokens(rt, hf, s.source, q, enable_thinking=False)
        on = s.ask(q, "Sum.\n</think>\n\nFour.", extra_body={"chat_template_kwargs": {"enable_thinking": True}})
        assert (on.choices[0].message.reasoning_content, on.choices[0].message.content) == ("Sum.", "Four.")
        assert on.usage.prompt_tokens == hf_prompt_tokens(rt, hf, s.source, q, enable_thinking=True)
        raw = s.ask(q, "Sum.\n</think>\n\nFour.", extra_body={"chat_template_kwargs": {"enable_thinking": True},
                                                               "reasoning_format": "none"})
        assert raw.choices[0].message.content == "Sum.\n</think>\n\nFour."
    with Served(rt, "openai-gpt-oss-120b") as s:
        r = s.ask(q, "<|channel|>final<|message|>Four.", reasoning_effort="high")
        assert r.choices[0].message.content == "Four."
        assert r.usage.prompt_tokens == hf_prompt_tokens(rt, hf, s.source, q, reasoning_effort="high")


@pytest.mark.parametrize("stem,change,param,code", [
    ("Qwen-Qwen3-0.6B", {"tools": "get_weather"}, "tools", "invalid_type"),
    ("Qwen-Qwen3-0.6B", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools", None),
    ("Qwen-Qwen3-0.6B", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "str"}}}}}]}, "tools", None),
    ("Qwen-Qwen3-0.6B", {"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", None),
    ("Qwen-Qwen3-0.6B", {"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", None),
    ("Qwen-Qwen3-0.6B", {"messages": ASK + [{"role": "tool", "tool_call_id": "x", "content": "1"}]}, "messages", None),
    ("Qwen-Qwen3-0.6B", {"messages": ASK + [{"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{oops"}}]}]},
     "messages", None),
    ("Qwen-Qwen3-0.6B", {"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", None),
    ("Mistral-Small-3.2-24B-Instruct-2506", {"messages": ASK + [  # Mistral wants 9-character ids
        {"role": "assistant", "tool_calls": [{"id": "short", "type": "function",
                                              "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "short", "content": "1"}]}, "messages", "chat_template_error"),
])
def test_bad_tool_input_is_a_400_in_openai_schema(rt, stem, change, param, code):
    body = {"model": MODEL, "messages": ASK, "tools": TOOLS, **change}
    with Served(rt, stem) as s:
        r = httpx.post(s.url + "/v1/chat/completions", json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["param"] == param and err["code"] == code
        assert err["type"] == "invalid_request_error" and "\n" not in err["message"]
        assert httpx.get(s.url + "/health").status_code == 200


def test_forced_output_needs_the_server_option(rt):
    with ServerThread(build_app(rt, MODEL)) as s:
        r = httpx.post(s.url + "/v1/chat/completions", json={"messages": ASK, "forced_output": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "forced_output"


def test_server_options_are_llama_servers_and_fail_in_one_line(tmp_path):
    import argparse

    from mawforge.errors import MawError
    from mawforge.commands.serve import add_arguments
    from mawforge.serve.servecli import chat_settings
    p = argparse.ArgumentParser()
    add_arguments(p)
    tpl = tmp_path / "t.jinja"
    tpl.write_text("{{ messages[0].content }}")
    (tmp_path / "broken.jinja").write_text("{% if %}")
    a = p.parse_args(["--pack", "x", "--chat-template-file", str(tpl), "--chat-template-kwargs",
                      '{"enable_thinking": false}', "--reasoning-format", "none", "--reasoning", "off",
                      "--reasoning-effort", "low"])
    got = chat_settings(a)
    assert got["chat_template"] == "{{ messages[0].content }}" and got["allow_forced_output"] is False
    d = got["chat_defaults"]
    assert (d.reasoning_format, d.reasoning, d.reasoning_effort, d.template_kwargs) == (
        "none", "off", "low", {"enable_thinking": False})
    for bad, msg in ((["--chat-template-kwargs", "{oops"], "not JSON"), (["--chat-template-kwargs", "[1]"], "object"),
                     (["--chat-template-file", str(tmp_path / "missing.jinja")], "cannot read"),
                     (["--chat-template-file", str(tmp_path / "broken.jinja")], "does not parse")):
        with pytest.raises(MawError, match=msg):
            chat_settings(p.parse_args(["--pack", "x", *bad]))


@pytest.mark.parametrize("stem", list(FAMILIES))
def test_server_prompt_is_transformers_prompt(rt, hf, stem):
    """The exact string the server tokenizes (OpenAI-shaped request in, arguments as JSON strings)
    against transformers' rendering of the same conversation."""
    from mawforge.text.chat import ChatTemplate
    from mawforge.front.chatreq import ChatFront, parse_chat_options
    from mawforge.front.protocol import parse_request
    source = (TEMPLATES / f"{stem}.jinja").read_text()
    call = {"id": "a1B2c3D4e", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": call["id"], "content": '{"temp": 21}'}]
    front = ChatFront(ChatTemplate(source, rt.tokenizer.chat.bos, rt.tokenizer.chat.eos))
    for body, tools in (({"messages": ASK, "tools": TOOLS}, TOOLS), ({"messages": history, "tools": TOOLS}, TOOLS),
                        ({"messages": ASK, "tools": TOOLS, "tool_choice": "none"}, None)):
        req = parse_request("chat", body, MODEL, 16)
        got = front.prepare(parse_chat_options(body, req.messages)).prompt
        hf.chat_template = source
        msgs = copy.deepcopy(body["messages"])
        for m in msgs:
            for c in m.get("tool_calls") or ():
                c["function"]["arguments"] = json.loads(c["function"]["arguments"])
            if m.get("content") is None:
                m["content"] = ""                # the server's reading of OpenAI's null content
        assert got == hf.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
