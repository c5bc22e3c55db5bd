"""text/tools.py + text/outparse.py: each family's tool-call and reasoning output, written as
the model writes it (the markers its template teaches), split into content, reasoning_content
and tool calls; fed whole and in small pieces, the answer must be the same (streaming cuts)."""
import json

import pytest

from mawforge.fixtures.sdist_templates import SdistMissing, template_dir
from mawforge.text.outparse import OutputParser, collect
from mawforge.text.tools import FORMATS, detect

SCHEMAS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
           "search": {"type": "object", "properties": {"q": {"type": "string"}}}}
PARIS = ("get_weather", {"city": "Paris", "days": 3})
Q = '<|"|>'

# (format, model output, start in reasoning, content, reasoning, calls)
CASES = [
    ("qwen-json", '<think>\nWeather needed.\n</think>\n\nLet me check.\n<tool_call>\n{"name": "get_weather", '
                  '"arguments": {"city": "Paris", "days": 3}}\n</tool_call>\n<tool_call>\n{"name": "search", '
                  '"arguments": {"q": "x"}}\n</tool_call>', False, "Let me check.", "Weather needed.",
     [PARIS, ("search", {"q": "x"})]),
    ("qwen-json", "Weather needed.\n</think>\n\nIt is sunny.", True, "It is sunny.", "Weather needed.", []),
    ("qwen-xml", "Hmm.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                 "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>", True, "", "Hmm.", [PARIS]),
    ("deepseek", "Plan.</think>Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
                 '{"city": "Paris", "days": 3}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
     True, "Sure.", "Plan.", [PARIS]),
    ("deepseek", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                 '{"city": "Paris", "days": 3}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', False, "", None, [PARIS]),
    ("deepseek-dsml", '<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" '
                      'string="true">Paris</｜DSML｜parameter>\n<｜DSML｜parameter name="days" string="false">3'
                      "</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>", False, "", None, [PARIS]),
    ("gpt-oss", "<|channel|>analysis<|message|>User wants weather.<|end|><|start|>assistant<|channel|>commentary "
                'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 3}<|call|>', False,
     "", "User wants weather.", [PARIS]),
    ("gpt-oss", "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>Four.",
     False, "Four.", "Easy.", []),
    ("gemma4", f"<|channel>thought\nCheck it.<channel|>On it.<|tool_call>call:get_weather{{city:{Q}Paris{Q},days:3}}"
               "<tool_call|>", False, "On it.", "Check it.", [PARIS]),
    ("glm", "<think>x</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
            "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>", False, "", "x", [PARIS]),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}', False, "", None, [PARIS]),
    ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}', False, "", None,
     [PARIS]),
    ("llama3", "Use {braces} freely.", False, "Use {braces} freely.", None, []),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}', False, "", None, [PARIS]),
    ("mistral", "[THINK]Think.[/THINK]Answer.", False, "Answer.", "Think.", []),
    ("mistral-json", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]', False, "",
     None, [PARIS]),
]
MALFORMED = [
    ("qwen-json", "Sure: <tool_call>\n{not json}\n</tool_call> done"),
    ("qwen-json", '<tool_call>\n{"name": "no_such_tool", "arguments": {}}\n</tool_call>'),
    ("qwen-json", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'),      # cut off
    ("qwen-xml", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis"),
    ("deepseek", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{bad<｜tool▁call▁end｜>"),
    ("gpt-oss", "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>[1]"),
    ("gemma4", f"<|tool_call>call:get_weather{{city:{Q}Paris<tool_call|>"),
    ("llama3", '{"name": "get_weather", "parameters": '),
    ("mistral", "[TOOL_CALLS]get_weather{no args marker}"),
]


def run(fmt: str, text: str, step: int, start_in_reasoning=False, **kw):
    p = OutputParser(FORMATS[fmt], SCHEMAS, start_in_reasoning=start_in_reasoning, **kw)
    pieces = []
    for i in range(0, len(text), step):
        pieces += p.feed(text[i:i + step])
    return collect(pieces + p.finish())


@pytest.mark.parametrize("step", [1, 3, 10_000])
@pytest.mark.parametrize("fmt,text,thinking,content,reasoning,calls", CASES, ids=[f"{c[0]}-{i}" for i, c in
                                                                                   enumerate(CASES)])
def test_family_output_is_split(fmt, text, thinking, content, reasoning, calls, step):
    got_content, got_reasoning, got_calls = run(fmt, text, step, thinking)
    assert (got_content, got_reasoning) == (content, reasoning)
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    assert [c.index for c in got_calls] == list(range(len(calls)))
    assert len({c.id for c in got_calls}) == len(calls)
    if FORMATS[fmt].short_ids:
        assert all(len(c.id) == 9 and c.id.isalnum() for c in got_calls)


@pytest.mark.parametrize("step", [1, 10_000])
@pytest.mark.parametrize("fmt,text", MALFORMED, ids=[f"{m[0]}-{i}" for i, m in enumerate(MALFORMED)])
def test_malformed_call_is_returned_as_text(fmt, text, step):
    content, reasoning, calls = run(fmt, text, step)
    assert calls == [] and reasoning is None
    # gpt-oss: the harmony headers before the recipient are protocol, not text, either way
    assert content == text.replace("<|start|>assistant<|channel|>commentary", "")


def test_without_tools_or_reasoning_the_markers_stay_text():
    text = "<think>a</think>b<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {}}\n</tool_call>"
    assert run("qwen-json", text, 2, reasoning=False, tools=False) == (text, None, [])
    assert run("plain", "x <think> y \n", 1) == ("x <think> y \n", None, [])


def test_plain_text_passes_through_exactly():
    text = "  Leading and trailing spaces, newlines\n\n and ümlauts  \n"
    for fmt in FORMATS:
        if fmt != "llama3":    # a leading '{' could start a Llama 3 call; not here
            assert run(fmt, text, 1)[0] == text, fmt


@pytest.mark.parametrize("stem,name", [
    ("Qwen-Qwen3-0.6B", "qwen-json"), ("Qwen3.5-4B", "qwen-xml"), ("Qwen3-Coder", "qwen-xml"),
    ("google-gemma-4-31B-it", "gemma4"), ("deepseek-ai-DeepSeek-V3.1", "deepseek"),
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "deepseek"), ("deepseek-ai-DeepSeek-V3.2", "deepseek-dsml"),
    ("openai-gpt-oss-120b", "gpt-oss"), ("GLM-4.6", "glm"), ("meta-llama-Llama-3.1-8B-Instruct", "llama3"),
    ("Mistral-Small-3.2-24B-Instruct-2506", "mistral"), ("mistralai-Mistral-Nemo-Instruct-2407", "mistral-json"),
])
def test_format_is_detected_from_the_real_template(stem, name):
    try:
        d = template_dir()
    except SdistMissing as e:
        pytest.skip(f"llama-cpp-python sdist not available: {e}")
    assert detect((d / f"{stem}.jinja").read_text()).name == name


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_any_mix_of_markers_never_raises(fmt):
    """Random text built from the format's own markers and fragments of them, in random pieces:
    the parser always answers, and every call it returns names an offered function with object arguments."""
    import random
    f = FORMATS[fmt]
    parts = [m for pair in f.think for m in pair] + list(f.open) + [f.close or ""] + list(f.drop) + [
        '{"name": "get_weather", "arguments": {"city": "Paris"}}', "call:get_weather{city:1}", "get_weather",
        " ", "\n", "x", "{", "}", "<", "|", ">", "[ARGS]", "Zürich"]
    rng = random.Random(fmt)
    for _ in range(200):
        text = "".join(rng.choice(parts) for _ in range(rng.randint(1, 12)))
        p = OutputParser(f, SCHEMAS, start_in_reasoning=rng.random() < 0.3)
        pieces, i = [], 0
        while i < len(text):
            n = rng.randint(1, 6)
            pieces += p.feed(text[i:i + n])
            i += n
        content, reasoning, calls = collect(pieces + p.finish())
        for c in calls:
            assert c.name in SCHEMAS and isinstance(json.loads(c.arguments), dict)
