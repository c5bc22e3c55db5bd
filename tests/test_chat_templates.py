"""Every chat template llama.cpp ships (llama-cpp-python 0.3.36 sdist) renders here exactly as
transformers' apply_chat_template renders it: system message, several turns, tool definitions,
assistant tool calls, tool results, and the switches the models read (enable_thinking,
reasoning_effort). Where transformers refuses a conversation, so must we. The templates of the
families MawForge runs must render every conversation."""
import copy

import pytest

from mawforge.text.chat import ChatTemplate
from mawforge.errors import RequestError
from mawforge.fixtures.sdist_templates import SdistMissing, template_dir

transformers = pytest.importorskip("transformers")

MISSING = ""
try:
    TEMPLATES = sorted(template_dir().glob("*.jinja"))
except SdistMissing as e:       # offline and no cached sdist: a missing host capability
    TEMPLATES, MISSING = [], str(e)

# The families MawForge runs (and Llama 3.x, Mistral): these must render every conversation.
MUST_RENDER = (
    "Qwen-Qwen3-0.6B", "Qwen3.5-4B", "Qwen3-Coder", "google-gemma-4-31B-it", "google-gemma-4-31B-it-interleaved",
    "deepseek-ai-DeepSeek-V3.1", "deepseek-ai-DeepSeek-V3.2", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B",
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B", "openai-gpt-oss-120b", "GLM-4.6",
    "GLM-4.7-Flash", "meta-llama-Llama-3.1-8B-Instruct", "meta-llama-Llama-3.2-3B-Instruct",
    "meta-llama-Llama-3.3-70B-Instruct", "mistralai-Mistral-Nemo-Instruct-2407",
    "Mistral-Small-3.2-24B-Instruct-2506", "mistralai-Ministral-3-14B-Reasoning-2512",
    "unsloth-mistral-Devstral-Small-2507",
)
BOS, EOS = "<|endoftext|>", "<|im_end|>"
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city <with> \"quotes\" & ümlauts",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City name"},
            "days": {"type": "integer", "description": "How many days"},
            "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "search", "description": "Search the web",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"},
                                                        "tags": {"type": "array", "items": {"type": "string"}}},
                       "required": ["q"]}}},
]
CALL_ID = "a1B2c3D4e"          # Mistral templates insist on 9 alphanumerics
CHAT = [
    {"role": "system", "content": "You are terse. Answer in English."},
    {"role": "user", "content": "Hello there, who are you?"},
    {"role": "assistant", "content": "A small model."},
    {"role": "user", "content": "Tell me about Zürich <b>now</b>."},
]
TOOL_CHAT = CHAT + [
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": CALL_ID, "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}}}]},
    {"role": "tool", "tool_call_id": CALL_ID, "name": "get_weather", "content": "{\"temp\": 21, \"sky\": \"clear\"}"},
    {"role": "assistant", "content": "It is 21 degrees and clear."},
    {"role": "user", "content": "And tomorrow?"},
]
CASES = {
    "plain": (CHAT, None, {}),
    "plain-no-generation-prompt": (CHAT[:3], None, {"add_generation_prompt": False}),
    "tools": (TOOL_CHAT, TOOLS, {}),
    "tools-pending-result": (TOOL_CHAT[:6], TOOLS, {}),
    "thinking-on": (TOOL_CHAT, TOOLS, {"enable_thinking": True}),
    "thinking-off": (CHAT, None, {"enable_thinking": False}),
    "reasoning-effort": (TOOL_CHAT, TOOLS, {"reasoning_effort": "high"}),
}


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import PreTrainedTokenizerFast

    from mawforge.fixtures.tokenizer import build_tokenizer
    return PreTrainedTokenizerFast(tokenizer_object=build_tokenizer("gpt2").tokenizer, bos_token=BOS, eos_token=EOS)


def _render_both(hf, source: str, case: str):
    messages, tools, kwargs = CASES[case]
    kwargs = dict(kwargs)
    gen = kwargs.pop("add_generation_prompt", True)
    hf.chat_template = source
    try:
        want = hf.apply_chat_template(copy.deepcopy(messages), tools=copy.deepcopy(tools), tokenize=False,
                                      add_generation_prompt=gen, **kwargs)
    except Exception as e:      # transformers refuses (raise_exception, or the template fails)
        want = e
    try:
        got = ChatTemplate(source, BOS, EOS).render(copy.deepcopy(messages), add_generation_prompt=gen,
                                                    tools=copy.deepcopy(tools), **kwargs)
    except RequestError as e:
        got = e
    return want, got


@pytest.mark.skipif(not TEMPLATES, reason=f"llama-cpp-python sdist not available: {MISSING}")
@pytest.mark.parametrize("path", TEMPLATES, ids=lambda p: p.stem)
def test_template_renders_as_transformers(hf_tokenizer, path):
    source = path.read_text()
    for case in CASES:
        want, got = _render_both(hf_tokenizer, source, case)
        if isinstance(want, Exception):
            assert isinstance(got, RequestError), f"{case}: transformers raised {want!r}, we rendered"
            assert path.stem not in MUST_RENDER, f"{case}: transformers refused: {want}"
            continue
        assert not isinstance(got, Exception), f"{case}: we raised {got}, transformers rendered"
        assert got == want, f"{case}: differs from transformers"


@pytest.mark.skipif(not TEMPLATES, reason=f"llama-cpp-python sdist not available: {MISSING}")
def test_all_families_are_present():
    stems = {p.stem for p in TEMPLATES}
    assert set(MUST_RENDER) <= stems


def test_environment_details_match_transformers(hf_tokenizer):
    """The details that differ from plain jinja2, on a template written to expose each one."""
    source = ("{{ messages[0].content | tojson }}|{{ tools | tojson(indent=2) }}|{{ documents is none }}|"
              "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}{% endfor %}|"
              "{% generation %}{{ bos_token }}{{ eos_token }}{% endgeneration %}|{{ extra }}|{{ strftime_now('%Y') }}")
    messages = [{"role": "user", "content": "Zürich <&> 'q'"}, {"role": "assistant", "content": "x"}]
    tools = [{"b": 1, "a": {"z": [1, 2]}}]
    hf_tokenizer.chat_template = source
    want = hf_tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, extra="E")
    assert ChatTemplate(source, BOS, EOS).render(messages, add_generation_prompt=False, tools=tools,
                                                 extra="E") == want


def test_raise_exception_and_broken_templates_are_request_and_format_errors():
    from mawforge.errors import FormatError
    with pytest.raises(RequestError, match="no system"):
        ChatTemplate("{{ raise_exception('no system') }}").render([{"role": "user", "content": "x"}])
    with pytest.raises(FormatError, match="does not parse"):
        ChatTemplate("{% if %}")
    with pytest.raises(RequestError, match="chat template failed"):
        ChatTemplate("{{ messages[5].content.x() }}").render([{"role": "user", "content": "x"}])


if __name__ == "__main__":      # counts for the README: PYTHONPATH=. python tests/test_chat_templates.py
    from transformers import PreTrainedTokenizerFast

    from mawforge.fixtures.tokenizer import build_tokenizer
    hf = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer("gpt2").tokenizer, bos_token=BOS, eos_token=EOS)
    results = [(p.stem, _render_both(hf, p.read_text(), case)) for p in TEMPLATES for case in CASES]
    equal = sum(not isinstance(w, Exception) and w == g for _, (w, g) in results)
    refused = sum(isinstance(w, Exception) and isinstance(g, Exception) for _, (w, g) in results)
    family = sum(s in MUST_RENDER and not isinstance(w, Exception) and w == g for s, (w, g) in results)
    print(f"{len(TEMPLATES)} templates x {len(CASES)} conversations: {equal} equal to transformers, {refused} "
          f"refused by both, {len(results) - equal - refused} different; family templates: {family} of "
          f"{len(MUST_RENDER) * len(CASES)} equal")
