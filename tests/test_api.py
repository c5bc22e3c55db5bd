"""The Python API as a user calls it: mawforge.load() on the shipped demo GGUF (packed on first
use), generate / complete / chat, the plan, telemetry, the one-line typed errors, close()."""
import json
import sys

import pytest

import mawforge
from mawforge.engine.generate import generate
from mawforge.engine.runtime import Runtime, RuntimeOptions
from mawforge.engine.sampling import SamplingParams
from mawforge.errors import BudgetRejected, FormatError, MawError, RequestError
from mawforge.demo import demo_gguf
from mawforge.plan import Budget

from helpers import run_cli

PROMPT = "In the beginning God created"


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("api-cache")


@pytest.fixture(scope="module")
def model(cache_dir):
    with mawforge.load(demo_gguf("Q4_K_M"), context=512, expert_cache_percent=50, cache_dir=cache_dir) as m:
        yield m


def test_import_is_light_and_load_is_the_api_function():
    code = ("import sys, mawforge; assert 'torch' not in sys.modules and 'mawforge.api' not in sys.modules; "
            "f = mawforge.load; import mawforge.api as a; assert f is a.load; assert 'load' in dir(mawforge)")
    import subprocess
    subprocess.run([sys.executable, "-c", code], check=True)
    with pytest.raises(AttributeError):
        mawforge.no_such_thing


def test_load_packs_a_gguf_once_into_the_cache_and_reuses_it(model, cache_dir):
    packs = [p for p in cache_dir.iterdir() if (p / "manifest.json").is_file()]
    assert len(packs) == 1 and packs[0].name.startswith("mawforge-demo-qwen3moe-Q4_K_M-")
    stamp = (packs[0] / "manifest.json").stat().st_mtime_ns
    assert mawforge.open_pack(demo_gguf("Q4_K_M"), cache_dir) == packs[0]
    assert (packs[0] / "manifest.json").stat().st_mtime_ns == stamp          # not packed again
    assert mawforge.open_pack(packs[0]) == packs[0]                           # a pack is itself
    assert not [p for p in cache_dir.iterdir() if p.name.startswith(".")]     # no partial pack left


def test_generate_streams_the_same_tokens_as_the_engine(model):
    events = list(model.generate(PROMPT, max_tokens=12, ignore_eos=True))
    assert [e.finish_reason for e in events[:-1]] == [None] * 11 and events[-1].finish_reason == "length"
    tele = events[-1].telemetry
    assert tele.completion_tokens == 12 and tele.prompt_tokens == len(model.encode(PROMPT))
    assert model.last_telemetry is tele
    # the same pack through the engine directly, in a runtime of its own
    rt = Runtime(mawforge.open_pack(demo_gguf("Q4_K_M"), model.runtime.pack.parent),
                 RuntimeOptions(context=512, expert_cache_percent=50))
    try:
        ref = [e.token for e in generate(rt, rt.tokenizer.encode(PROMPT),
                                         SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))]
    finally:
        rt.close()
    assert [e.token for e in events] == ref
    assert "".join(e.text for e in events) == model.decode(ref)


def test_token_ids_in_and_complete(model):
    ids = model.encode(PROMPT)
    a = model.complete(ids, max_tokens=8, ignore_eos=True)
    b = model.complete(PROMPT, max_tokens=8, ignore_eos=True)
    assert a.tokens == b.tokens and a.text == b.text and len(a.tokens) == 8
    assert b.telemetry.cached_tokens == len(ids)          # the prompt cache is on by default
    assert a.finish_reason == "length" and a.telemetry.prompt_tokens == len(ids)
    s1 = model.complete(PROMPT, max_tokens=8, temperature=0.9, seed=7)
    s2 = model.complete(PROMPT, max_tokens=8, temperature=0.9, seed=7)
    assert s1.tokens == s2.tokens


def test_stop_string_cuts_the_text(model):
    full = model.complete(PROMPT, max_tokens=16, ignore_eos=True).text
    word = full.split()[2]
    cut = model.complete(PROMPT, max_tokens=16, ignore_eos=True, stop=word)
    assert cut.finish_reason == "stop" and word not in cut.text and full.startswith(cut.text)


def test_chat_uses_the_template_and_the_servers_parsing(model):
    msgs = [{"role": "user", "content": "What does Genesis 1:3 say?"}]
    turn = model.chat_turn(msgs)
    assert turn.prompt == model.tokenizer.chat.render(msgs, add_generation_prompt=True)
    reply = model.chat(msgs, max_tokens=24)
    assert reply.message["role"] == "assistant" and isinstance(reply.content, str) and reply.content
    assert reply.finish_reason in ("stop", "length") and reply.tool_calls == []
    assert reply.telemetry.prompt_tokens == len(model.encode(turn.prompt))


@pytest.fixture(scope="module")
def qwen_model(cache_dir):
    """The demo pack with Qwen3's real chat template (the llama-cpp-python sdist's copy), whose
    tool-call format (hermes <tool_call> JSON) the server and the API constrain."""
    from mawforge.fixtures.sdist_templates import SdistMissing, template_dir
    try:
        source = (template_dir() / "Qwen-Qwen3-0.6B.jinja").read_text()
    except SdistMissing as e:
        pytest.skip(f"llama-cpp-python sdist not available: {e}")
    with mawforge.load(demo_gguf("Q4_K_M"), context=512, expert_cache_percent=50, cache_dir=cache_dir,
                       chat_template=source) as m:
        yield m


def test_chat_with_a_named_tool_returns_a_schema_valid_call(qwen_model):
    model = qwen_model
    params = {"type": "object", "properties": {"book": {"enum": ["Genesis", "Exodus"]}, "verse": {"type": "integer",
              "minimum": 1, "maximum": 99}}, "required": ["book", "verse"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "lookup", "description": "look a verse up",
                                               "parameters": params}}]
    reply = model.chat([{"role": "user", "content": "Genesis 1:3"}], tools=tools,
                       tool_choice={"type": "function", "function": {"name": "lookup"}}, max_tokens=60)
    # the call is forced and its arguments constrained to the schema, as the server does
    assert reply.finish_reason == "tool_calls" and len(reply.tool_calls) == 1
    call = reply.tool_calls[0]
    assert call["function"]["name"] == "lookup"
    args = json.loads(call["function"]["arguments"])
    assert args["book"] in ("Genesis", "Exodus") and 1 <= args["verse"] <= 99 and set(args) == {"book", "verse"}
    with pytest.raises(RequestError, match="tool_choice"):
        model.chat([{"role": "user", "content": "x"}], tools=tools,
                   tool_choice={"type": "function", "function": {"name": "nope"}})


def test_response_format_constrains_generate_and_chat(model):
    schema = {"type": "object", "properties": {"book": {"type": "string", "maxLength": 12},
                                               "verse": {"type": "integer", "minimum": 1, "maximum": 99}},
              "required": ["book", "verse"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "ref", "schema": schema, "strict": True}}
    out = model.complete("Genesis 1:3 as JSON:", max_tokens=60, response_format=fmt)
    assert out.finish_reason == "stop"
    got = json.loads(out.text)
    assert set(got) == {"book", "verse"} and isinstance(got["verse"], int)
    reply = model.chat([{"role": "user", "content": "Name a book."}], max_tokens=60,
                       response_format={"type": "json_object"})
    assert isinstance(json.loads(reply.content), dict)
    with pytest.raises(RequestError, match="response_format"):
        model.complete("x", response_format={"type": "xml"})


def test_bad_requests_raise_typed_one_line_errors(model):
    with pytest.raises(RequestError, match="empty"):
        model.generate([])
    with pytest.raises(RequestError, match="context"):
        model.generate([1] * 600)
    with pytest.raises(RequestError, match="max_tokens"):
        model.generate(PROMPT, max_tokens=0)
    with pytest.raises(RequestError, match="token ids"):
        model.generate([1, "a"])
    with pytest.raises(RequestError, match="messages"):
        model.chat([])
    assert issubclass(RequestError, MawError) and issubclass(mawforge.ModelClosed, MawError)


def test_one_stream_at_a_time(model):
    first = model.generate(PROMPT, max_tokens=4, ignore_eos=True)
    next(first)
    with pytest.raises(mawforge.Busy):
        next(model.generate(PROMPT, max_tokens=4))
    first.close()                                            # an abandoned stream frees the model
    assert len(model.complete(PROMPT, max_tokens=4, ignore_eos=True).tokens) == 4


def test_plan_without_loading_and_rejection(model, cache_dir):
    pack = model.runtime.pack
    p = mawforge.plan_for(pack, memory_budget_gib=1, context=512, expert_cache_percent=50)
    assert p.feasible and p.F == p.C + p.E + p.K + p.P + p.O and p.P > 0       # the auto prompt cache
    assert model.plan.E == p.E and model.plan.C == p.C
    with pytest.raises(BudgetRejected, match="plan rejected"):
        mawforge.load(pack, memory_budget_gib=0.01, context=512)


def test_a_q8_0_kv_cache_through_the_api(model, cache_dir):
    """kv_dtype="q8_0" plans and allocates ggml's 8-bit rows (34 bytes a 32 values, against 64 in
    float16), and on the demo model greedy decoding gives the float16 cache's tokens; a dtype
    there is none of is a one-line error before anything loads."""
    pack = model.runtime.pack
    f16 = mawforge.plan_for(pack, context=512, kv_dtype="float16")
    with mawforge.load(pack, context=512, expert_cache_percent=50, kv_dtype="q8_0") as m:
        assert m.plan.kv_dtype == "q8_0" and m.plan.K * 64 == f16.K * 34 == m.runtime.kv.nbytes * 64
        got = [e.token for e in m.generate(PROMPT, max_tokens=12, ignore_eos=True)]
    with mawforge.load(pack, context=512, expert_cache_percent=50, kv_dtype="float16") as m:
        assert got == [e.token for e in m.generate(PROMPT, max_tokens=12, ignore_eos=True)]
    with pytest.raises(FormatError, match="unknown KV cache dtype 'q4_0'; choose from float32, bfloat16, float16"):
        mawforge.load(pack, context=512, kv_dtype="q4_0")


def test_the_budget_is_bytes_with_its_source(model):
    """GiB given to the API become a Budget the plan names as the API's; a Budget passes through
    with its own source (how the commands hand over --memory-budget-gib)."""
    pack = model.runtime.pack
    p = mawforge.plan_for(pack, memory_budget_gib=1, context=512)
    assert (p.budget_bytes, p.budget_source) == (1 << 30, "memory_budget_gib=") and "[memory_budget_gib=]" in p.table()
    q = mawforge.plan_for(pack, memory_budget_gib=Budget(1 << 30, "--memory-budget-gib"), context=512)
    assert q.budget_source == "--memory-budget-gib" and (q.E, q.F) == (p.E, p.F)
    assert mawforge.plan_for(pack, context=512).budget_source.startswith("default: the ")   # the memory it can have
    with pytest.raises(TypeError, match="plan.Budget"):
        RuntimeOptions(budget=1.0)


def test_planning_loads_no_torch(model):
    """`mawforge plan`, bench and tune plan through the API without loading the framework."""
    code = ("import sys, mawforge.api as a, mawforge.bench.tune, mawforge.bench.matrix, mawforge.commands.plan; "
            f"p = a.plan_for({str(model.runtime.pack)!r}, memory_budget_gib=1, context=512); "
            "assert p.feasible and 'torch' not in sys.modules, 'torch was imported'")
    import subprocess
    subprocess.run([sys.executable, "-c", code], check=True)


def test_bad_paths_fail_clearly(tmp_path):
    with pytest.raises(FormatError, match="no such file"):
        mawforge.load(tmp_path / "missing.gguf")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FormatError, match="neither a pack"):
        mawforge.load(tmp_path / "empty")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(FormatError):
        mawforge.load(bad, cache_dir=tmp_path / "cache")
    assert list((tmp_path / "cache").glob("*")) == []            # nothing half-written is left


def test_closed_model_refuses_calls(cache_dir):
    m = mawforge.load(demo_gguf("Q4_K_M"), context=256, expert_cache_percent=25, cache_dir=cache_dir)
    m.close()
    m.close()                                                  # closing twice is fine
    assert m.closed
    for call in (lambda: m.generate(PROMPT), lambda: m.chat([{"role": "user", "content": "x"}]),
                 lambda: m.encode("x")):
        with pytest.raises(mawforge.ModelClosed, match="closed"):
            call()


def test_run_command_stands_on_the_api(model):
    pack = str(model.runtime.pack)
    out = run_cli("run", "--pack", pack, "--context", "512", "--expert-cache-percent", "50",
                  "--max-tokens", "8", "--ignore-eos", PROMPT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.rstrip("\n") == model.complete(PROMPT, max_tokens=8, ignore_eos=True).text
