"""POST /v1/responses through the whole server: the official openai client (responses.create,
create(stream=True), responses.stream) against the shipped demo model on a free port. Every
response and every stream event is also validated with the openai package's own pydantic types
(Response, ResponseStreamEvent), and the events' order is checked against OpenAI's. Tool calls
and reasoning use Qwen3's real chat template (the llama-cpp-python sdist's copy) and the testing
hook forced_output; prompts are compared with the chat endpoint's for the same conversation."""
import argparse
import json
import re
from typing import get_args

import httpx
import openai
import pytest
import torch
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from mawforge.demo import demo_gguf
from mawforge.engine.generate import generate
from mawforge.engine.runtime import Runtime, RuntimeOptions
from mawforge.engine.sampling import SamplingParams
from mawforge.errors import MawError, RequestError
from mawforge.pack.packer import pack
from mawforge.plan import Budget
from mawforge.commands.serve import add_arguments
from mawforge.serve.app import ServerThread, build_app
from mawforge.front.protocol import ApiError
from mawforge.serve.responses import ResponseStore, store_from_args
from mawforge.serve.respreq import text_format

MODEL, CONTEXT = "tiny-responses", 2048
EVENT = TypeAdapter(ResponseStreamEvent)
# the union's model per event type: validated first, so a failure names the fields of that type only
EVENTS = {t.model_fields["type"].annotation.__args__[0]: t for t in get_args(get_args(ResponseStreamEvent)[0])}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL = ('<think>\nUser wants weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
        '\n</tool_call>')
ASK = "Weather in Paris?"

# OpenAI's event order: one letter per event type, the whole stream must match STREAM
LETTERS = {"response.created": "C", "response.in_progress": "P", "response.output_item.added": "A",
           "response.content_part.added": "a", "response.output_text.delta": "t", "response.output_text.done": "T",
           "response.reasoning_text.delta": "r", "response.reasoning_text.done": "R",
           "response.reasoning_summary_part.added": "s", "response.reasoning_summary_text.delta": "u",
           "response.reasoning_summary_text.done": "U", "response.reasoning_summary_part.done": "S",
           "response.content_part.done": "d", "response.function_call_arguments.delta": "f",
           "response.function_call_arguments.done": "F", "response.output_item.done": "D",
           "response.completed": "Z", "response.incomplete": "I", "response.failed": "X"}
STREAM = re.compile(r"CP((Aat*Td)D|(Aar*Rd)(suUS)?D|(Af+F)D)*[ZIX]")


@pytest.fixture(scope="module")
def rt(tmp_path_factory):
    root = tmp_path_factory.mktemp("responses")
    pack(demo_gguf("Q8_0"), root / "pack", progress=False)
    threads = torch.get_num_threads()
    runtime = Runtime(root / "pack", RuntimeOptions(context=CONTEXT, budget=Budget(2 << 30, "test"),
                                                    expert_cache_percent=50, threads=1))
    yield runtime
    runtime.close()
    torch.set_num_threads(threads)


class Served:
    def __init__(self, rt, max_tokens_default=8, **kw):
        self.thread = ServerThread(build_app(rt, MODEL, max_tokens_default=max_tokens_default,
                                             allow_forced_output=True, dashboard=False, **kw))

    def __enter__(self):
        self.thread.__enter__()
        self.url = self.thread.url
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0)
        return self

    def __exit__(self, *exc):
        self.thread.__exit__(*exc)

    def post(self, **body) -> httpx.Response:
        return httpx.post(self.url + "/v1/responses", json={"model": MODEL, **body}, timeout=120)

    def create(self, **body) -> dict:
        r = self.post(**body)
        assert r.status_code == 200, r.text
        Response.model_validate(r.json())            # strict: a missing or mistyped field fails here
        return r.json()

    def events(self, **body) -> list[dict]:
        """The raw SSE stream: each `event:` line names its data's type; each data validates."""
        out = []
        with httpx.stream("POST", self.url + "/v1/responses", json={"model": MODEL, "stream": True, **body},
                          timeout=120) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            name = None
            for line in r.iter_lines():
                if line.startswith("event: "):
                    name = line[7:]
                elif line.startswith("data: "):
                    data = json.loads(line[6:])
                    assert data["type"] == name
                    EVENTS[data["type"]].model_validate(data)
                    assert type(EVENT.validate_python(data)) is EVENTS[data["type"]]
                    out.append(data)
        check_stream(out)
        return out


def check_stream(events: list[dict]) -> dict:
    """OpenAI's order and bookkeeping; returns the final response."""
    assert STREAM.fullmatch("".join(LETTERS[e["type"]] for e in events)), [e["type"] for e in events]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    Response.model_validate(final)
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done == final["output"]
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert [e["output_index"] for e in added] == list(range(len(done)))
    for e in events:
        if "item_id" in e:
            assert final["output"][e["output_index"]]["id"] == e["item_id"]
    for i, item in enumerate(final["output"]):
        deltas = "".join(e["delta"] for e in events if e.get("output_index") == i and e["type"].endswith("text.delta")
                         and "summary" not in e["type"])
        args = "".join(e["delta"] for e in events if e.get("output_index") == i
                       and e["type"] == "response.function_call_arguments.delta")
        if item["type"] == "function_call":
            assert args == item["arguments"]
        else:
            assert deltas == item["content"][0]["text"]
    assert events[0]["response"]["id"] == final["id"] and events[0]["response"]["status"] == "in_progress"
    return final


def output_text(r: dict) -> str:
    return "".join(p["text"] for o in r["output"] if o["type"] == "message" for p in o["content"])


@pytest.fixture(scope="module")
def plain(rt):
    with Served(rt, responses_store=ResponseStore(max_entries=64)) as s:
        yield s


@pytest.fixture(scope="module")
def qwen(rt):
    from mawforge.fixtures.sdist_templates import SdistMissing, template_dir
    try:
        source = (template_dir() / "Qwen-Qwen3-0.6B.jinja").read_text()
    except SdistMissing as e:
        pytest.skip(f"llama-cpp-python sdist not available: {e}")
    with Served(rt, max_tokens_default=200, chat_template=source) as s:
        yield s


def test_text_response_is_the_chat_answer_and_validates(plain):
    r = plain.create(input="Tell me about expert caches.", temperature=0, max_output_tokens=6)
    chat = plain.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content":
                                                "Tell me about expert caches."}], temperature=0, max_tokens=6)
    assert r["id"].startswith("resp_") and r["object"] == "response" and r["model"] == MODEL
    assert output_text(r) == chat.choices[0].message.content
    assert r["usage"]["input_tokens"] == chat.usage.prompt_tokens
    assert r["usage"]["output_tokens"] == chat.usage.completion_tokens == r["telemetry"]["completion_tokens"]
    assert r["usage"]["total_tokens"] == chat.usage.total_tokens
    assert r["usage"]["output_tokens_details"]["reasoning_tokens"] == 0
    length = chat.choices[0].finish_reason == "length"
    assert r["status"] == ("incomplete" if length else "completed")
    assert r["incomplete_details"] == ({"reason": "max_output_tokens"} if length else None)
    typed = plain.client.responses.create(model=MODEL, input="Tell me about expert caches.", temperature=0,
                                          max_output_tokens=6)
    assert typed.output_text == output_text(r) and typed.status == r["status"]


def test_max_output_tokens_ends_incomplete_streamed_and_not(rt, plain):
    ids = rt.tokenizer.encode(rt.tokenizer.chat.render([{"role": "user", "content": "Go on"}],
                                                       add_generation_prompt=True))
    assert list(generate(rt, ids, SamplingParams(max_tokens=3)))[-1].finish_reason == "length"   # no EOS in 3
    r = plain.create(input="Go on", temperature=0, max_output_tokens=3)
    events = plain.events(input="Go on", temperature=0, max_output_tokens=3)
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.incomplete" and r["status"] == final["status"] == "incomplete"
    assert final["incomplete_details"] == r["incomplete_details"] == {"reason": "max_output_tokens"}
    assert output_text(final) == output_text(r) and final["output"][-1]["status"] == "incomplete"
    assert final["usage"]["output_tokens"] == 3
    typed = list(plain.client.responses.create(model=MODEL, input="Go on", temperature=0, max_output_tokens=3,
                                               stream=True))
    assert [e.type for e in typed] == [e["type"] for e in events]
    assert typed[-1].response.output_text == output_text(r)


def test_stream_helper_and_forced_answer_complete(plain):
    with plain.client.responses.stream(model=MODEL, input="Hi", extra_body={"forced_output": "Hello there."}) as s:
        deltas = [e.delta for e in s if e.type == "response.output_text.delta"]
        final = s.get_final_response()
    assert final.status == "completed" and final.output_text == "Hello there." == "".join(deltas)
    assert final.completed_at is not None and final.usage.output_tokens > 0
    events = plain.events(input="Hi", forced_output="Hello there.")
    assert events[-1]["type"] == "response.completed" and output_text(events[-1]["response"]) == "Hello there."


def test_instructions_and_previous_response_id_render_the_whole_conversation(plain):
    c = plain.client
    kw = {"model": MODEL, "temperature": 0, "max_output_tokens": 4}
    r1 = c.responses.create(input="Hi", instructions="Be brief.", **kw)
    chat1 = c.chat.completions.create(model=MODEL, temperature=0, max_tokens=4, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert r1.instructions == "Be brief." and r1.usage.input_tokens == chat1.usage.prompt_tokens
    assert r1.output_text == chat1.choices[0].message.content

    r2 = c.responses.create(previous_response_id=r1.id, input="More.", **kw)     # instructions are not carried
    r3 = c.responses.create(input=[{"role": "user", "content": "Hi"}, *r1.output, {"role": "user", "content": "More."}],
                            store=False, **kw)
    chat2 = c.chat.completions.create(model=MODEL, temperature=0, max_tokens=4, messages=[
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": r1.output_text},
        {"role": "user", "content": "More."}])
    assert r2.previous_response_id == r1.id
    assert r2.usage.input_tokens == r3.usage.input_tokens == chat2.usage.prompt_tokens
    assert r2.output_text == r3.output_text == chat2.choices[0].message.content

    assert c.responses.retrieve(r2.id).model_dump() == r2.model_dump()
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(r3.id)                 # store: false
    bad = plain.post(input="x", previous_response_id=r3.id)
    assert bad.status_code == 404 and bad.json()["error"] == {
        "message": f"Previous response with id '{r3.id}' not found.", "type": "invalid_request_error",
        "param": "previous_response_id", "code": "previous_response_not_found"}
    c.responses.delete(r2.id)
    assert httpx.get(f"{plain.url}/v1/responses/{r2.id}").status_code == 404
    assert httpx.delete(f"{plain.url}/v1/responses/{r2.id}").status_code == 404


def test_tool_call_round_trip_by_previous_response_id_and_by_items(qwen):
    c = qwen.client
    r = qwen.create(input=ASK, tools=[WEATHER], forced_output=CALL, reasoning={"summary": "auto"})
    assert [o["type"] for o in r["output"]] == ["reasoning", "function_call"] and r["status"] == "completed"
    reasoning, call = r["output"]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "User wants weather."}]
    assert reasoning["summary"] == [{"type": "summary_text", "text": "User wants weather."}]
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}
    assert call["call_id"].startswith("call_") and call["id"].startswith("fc_") and call["status"] == "completed"
    assert 0 < r["usage"]["output_tokens_details"]["reasoning_tokens"] < r["usage"]["output_tokens"]
    assert r["tools"][0]["name"] == "get_weather" and r["tool_choice"] == "auto"

    result = {"type": "function_call_output", "call_id": call["call_id"], "output": '{"temp": 21}'}
    answer = {"tools": [WEATHER], "forced_output": "It is 21 degrees."}
    by_id = qwen.create(previous_response_id=r["id"], input=[result], **answer)
    by_items = qwen.create(input=[{"role": "user", "content": ASK}, *r["output"], result], store=False, **answer)
    chat = c.chat.completions.create(model=MODEL, tools=[{"type": "function", "function": {
        k: v for k, v in WEATHER.items() if k != "type"}}], extra_body={"forced_output": "It is 21 degrees."},
        messages=[{"role": "user", "content": ASK},
                  {"role": "assistant", "content": "", "reasoning_content": "User wants weather.",
                   "tool_calls": [{"id": call["call_id"], "type": "function",
                                   "function": {"name": "get_weather", "arguments": call["arguments"]}}]},
                  {"role": "tool", "tool_call_id": call["call_id"], "content": '{"temp": 21}'}])
    assert by_id["usage"]["input_tokens"] == by_items["usage"]["input_tokens"] == chat.usage.prompt_tokens
    assert output_text(by_id) == output_text(by_items) == "It is 21 degrees." == chat.choices[0].message.content
    assert [o["type"] for o in by_id["output"]] == ["message"]

    named = c.responses.create(model=MODEL, input=ASK, tools=[WEATHER], tool_choice={"type": "function",
                               "name": "get_weather"}, extra_body={"forced_output": '{"city": "Paris"}}\n</tool_call>'})
    assert [(o.type, o.name, json.loads(o.arguments)) for o in named.output] == [
        ("function_call", "get_weather", {"city": "Paris"})]


def test_streamed_tool_call_and_reasoning_events(qwen):
    events = qwen.events(input=ASK, tools=[WEATHER], forced_output=CALL)
    final = events[-1]["response"]
    assert [o["type"] for o in final["output"]] == ["reasoning", "function_call"]
    assert [e["type"] for e in events if "reasoning_text" in e["type"]][-1] == "response.reasoning_text.done"
    assert sum(e["type"] == "response.function_call_arguments.delta" for e in events) > 1
    with qwen.client.responses.stream(model=MODEL, input=ASK, tools=[WEATHER], extra_body={"forced_output": CALL}) as s:
        args = "".join(e.delta for e in s if e.type == "response.function_call_arguments.delta")
        done = s.get_final_response()
    assert json.loads(args) == {"city": "Paris"} and done.output[-1].arguments == args


def test_streamed_reasoning_with_summary_then_answer(qwen):
    events = qwen.events(input="2+2?", forced_output="<think>\nTwo and two.\n</think>\n\nFour.",
                         reasoning={"summary": "detailed"})
    final = events[-1]["response"]
    assert [o["type"] for o in final["output"]] == ["reasoning", "message"] and final["status"] == "completed"
    assert final["output"][0]["summary"] == [{"type": "summary_text", "text": "Two and two."}]
    assert [e["text"] for e in events if e["type"] == "response.reasoning_summary_text.done"] == ["Two and two."]
    assert output_text(final) == "Four." and final["reasoning"]["summary"] == "detailed"


def test_reasoning_effort_none_turns_thinking_off_as_chat_does(qwen):
    ask = [{"role": "user", "content": "2+2?"}]
    off = qwen.create(input=ask, reasoning={"effort": "none"}, forced_output="Four.")
    on = qwen.create(input=ask, forced_output="Four.")
    chat = qwen.client.chat.completions.create(model=MODEL, messages=ask, reasoning_effort="none",
                                               extra_body={"forced_output": "Four."})
    assert off["usage"]["input_tokens"] == chat.usage.prompt_tokens != on["usage"]["input_tokens"]
    assert off["reasoning"]["effort"] == "none" and output_text(off) == "Four."


def test_text_format_maps_to_the_chat_response_format_shape(plain):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    assert text_format(None) == text_format({"type": "text"}) == {"type": "text"}
    assert text_format({"type": "json_object"}) == {"type": "json_object"}
    assert text_format({"type": "json_schema", "name": "pt", "schema": schema, "strict": True}) == {
        "type": "json_schema", "json_schema": {"name": "pt", "schema": schema, "strict": True}}
    assert text_format({"type": "json_schema", "name": "pt", "schema": schema})["json_schema"]["strict"] is False
    for bad, param in [({"type": "xml"}, "text.format"),
                       ({"type": "json_schema", "schema": schema}, "text.format.name"),
                       ({"type": "json_schema", "name": "pt", "schema": []}, "text.format.schema")]:
        with pytest.raises(ApiError) as e:
            text_format(bad)
        assert e.value.param == param
    fmt = {"type": "json_schema", "name": "pt", "schema": schema, "strict": True}
    r = plain.create(input="A point?", text={"format": fmt}, forced_output='{"a": 1}')
    assert r["text"]["format"] == fmt and output_text(r) == '{"a": 1}'


def test_text_format_json_schema_constrains_the_output(plain):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "name": "count", "schema": schema, "strict": True}
    r = plain.create(input="A number?", text={"format": fmt}, max_output_tokens=40, temperature=0)
    assert r["status"] == "completed" and isinstance(json.loads(output_text(r))["n"], int)
    events = plain.events(input="A number?", text={"format": {"type": "json_object"}}, max_output_tokens=40,
                          temperature=0)
    assert isinstance(json.loads(output_text(events[-1]["response"])), dict)


@pytest.mark.parametrize("error,status,code", [(RuntimeError("boom"), 500, "server_error"),
                                               (RequestError("boom: the request's own fault"), 400, "invalid_prompt")])
def test_an_engine_failure_mid_stream_is_response_failed(rt, error, status, code):
    ids = rt.tokenizer.encode(rt.tokenizer.chat.render([{"role": "user", "content": "Hi"}], add_generation_prompt=True))
    first_two = "".join(ev.text for ev in list(generate(rt, ids, SamplingParams(max_tokens=2))))

    def failing(rt_, ids, params, **kw):
        for i, ev in enumerate(generate(rt_, ids, params, **kw)):
            if i == 2:
                raise error
            yield ev
    with Served(rt, generate_fn=failing) as s:
        events = s.events(input="Hi", max_output_tokens=6, temperature=0)
        whole = s.post(input="Hi", max_output_tokens=6)
        assert httpx.get(s.url + "/health").json()["status"] == "ok"
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.failed" and final["status"] == "failed"
    assert final["error"]["code"] == code and "boom" in final["error"]["message"]
    assert output_text(final) == first_two                        # what was streamed is kept
    assert whole.status_code == status and "boom" in whole.json()["error"]["message"]


def test_store_is_a_bounded_lru():
    s = ResponseStore(max_entries=2, max_bytes=10_000)
    for rid in ("a", "b"):
        assert s.put(rid, {"id": rid}, [])
    s.get("a")                                               # a is now the most recent
    s.put("c", {"id": "c"}, [])
    assert s.get("b") is None and s.get("a") is not None and s.get("c") is not None
    assert not s.put("big", {"id": "big"}, ["x" * 20_000]) and s.get("big") is None
    s.put("d", {"id": "d"}, ["y" * 9_975])                    # fits alone (~9,997 bytes): the others go
    assert s.get("d") is not None and s.get("a") is None and s.get("c") is None
    assert s.bytes <= s.max_bytes and s.delete("d") and not s.delete("d") and s.bytes == 0


def test_store_flags_size_it():
    p = argparse.ArgumentParser()
    add_arguments(p)
    store = store_from_args(p.parse_args(["--pack", "x", "--responses-store-count", "3",
                                          "--responses-store-mb", "0.5"]))
    assert (store.max_entries, store.max_bytes) == (3, 1 << 19)
    with pytest.raises(MawError):
        store_from_args(p.parse_args(["--pack", "x", "--responses-store-count", "-1"]))


@pytest.mark.parametrize("change,status,param,code", [
    ({"input": None}, 400, "input", None),
    ({"input": []}, 400, "input", None),
    ({"input": [{"type": "item_reference", "id": "x"}]}, 400, "input", None),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "input", None),
    ({"input": [{"role": "wizard", "content": "hi"}]}, 400, "input", None),
    ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "1"}]}, 400, "input", None),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{oops"}]}, 400, "input", None),
    ({"model": None}, 400, "model", None),
    ({"model": "other"}, 404, "model", "model_not_found"),
    ({"max_output_tokens": 0}, 400, "max_output_tokens", None),
    ({"max_output_tokens": CONTEXT}, 400, "max_output_tokens", "context_length_exceeded"),
    ({"temperature": "hot"}, 400, "temperature", None),
    ({"tools": [{"type": "web_search"}]}, 400, "tools", None),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, 400, "tool_choice", None),
    ({"tool_choice": {"type": "allowed_tools"}}, 400, "tool_choice", None),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format.schema", None),
    ({"reasoning": {"summary": "long"}}, 400, "reasoning.summary", None),
    ({"reasoning": {"effort": "extreme"}}, 400, "reasoning.effort", None),
    ({"user": 7}, 400, "user", None),
    ({"instructions": ["Be brief."]}, 400, "instructions", None),
    ({"metadata": {"k": 1}}, 400, "metadata", None),
    ({"store": "yes"}, 400, "store", None),
    ({"background": True}, 400, "background", None),
    ({"truncation": "auto"}, 400, "truncation", None),
    ({"max_tokens": 5}, 400, "max_tokens", "unknown_parameter"),
    ({"previous_response_id": "resp_unknown"}, 404, "previous_response_id", "previous_response_not_found"),
    ({"input": "word " * 4000}, 400, "input", "context_length_exceeded"),
])
def test_bad_input_is_an_openai_error_naming_the_field(plain, change, status, param, code):
    r = plain.post(**{"input": "Hi", **change})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and (err["param"], err["code"]) == (param, code)
    assert err["type"] == "invalid_request_error" and "\n" not in err["message"]
