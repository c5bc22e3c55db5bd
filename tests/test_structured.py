"""Structured outputs (llguidance): token-bytes tables of every vocabulary kind against the
tokenizer and llguidance's own tokenizer.json reader; json_schema / json_object / forced tool calls
through the engine (tiny fixture packs, the demo model) and through the server with the official
openai client; speculative output equal to plain output; the 400s and the dead end.
Outputs are checked with `jsonschema` (a validator nobody here wrote)."""
from __future__ import annotations

import json

import jsonschema
import llguidance as llg
import openai
import pytest
import torch

from mawforge.demo import demo_gguf
from mawforge.engine import constraint as C
from mawforge.plan import Budget
from mawforge.speculative.drafters import Drafter
from mawforge.engine.generate import generate
from mawforge.engine.runtime import Runtime, RuntimeOptions
from mawforge.engine.sampling import SamplingParams
from mawforge.speculative.decode import SpecOptions, Speculator
from mawforge.text.tokenizer import _from_hf, from_gguf_metadata
from mawforge.fixtures.build import build_fixtures
from mawforge.fixtures.hf_tokenizers import build_family
from mawforge.pack.packer import pack
from mawforge.serve.app import ServerThread, build_app
from mawforge.front.structured import JSON_CALLS, tool_grammar
from mawforge.text.tools import FORMATS

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "name", "n", "tags"],
          "properties": {"city": {"enum": ["Zürich", "東京", "Paris 😀"]}, "name": {"type": "string", "maxLength": 10},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3}}}
DOC = {"city": "東京", "name": "ï “é” 😀", "n": 7, "tags": ["ü", "日本"]}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "strict": True, "parameters": {
        "type": "object", "additionalProperties": False, "required": ["city", "unit"],
        "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["°C", "°F"]}}}}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "required": ["q"], "properties": {"q": {"type": "string", "maxLength": 12}}}}}]
TEXTS = ('{"a": "naïve café — “quoted” 日本語 😀"}', "def f(x):\n\treturn {'k': [x, None]}\n", "  spaces\n\nand ü")


# ---- the token-bytes table of every vocabulary kind ----------------------------------------

def _gguf_vocab(name: str):
    from mawforge.fixtures.llama_vocabs import vocab_dir
    from mawforge.fixtures.sdist import SdistMissing
    from mawforge.formats.gguf import read_header
    try:
        root = vocab_dir()
    except SdistMissing as e:
        pytest.skip(f"llama.cpp's vocabularies are not available: {e}")
    return from_gguf_metadata(read_header(root / f"ggml-vocab-{name}.gguf")[0])


SOURCES = {"gguf-gemma-4": lambda tmp: _gguf_vocab("gemma-4"), "gguf-llama-spm": lambda tmp: _gguf_vocab("llama-spm"),
           **{f"hf-{fam}": (lambda tmp, fam=fam: _from_hf(build_family(fam, tmp / fam)))
              for fam in ("qwen3", "gemma4", "gpt_oss")}}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root, made = tmp_path_factory.mktemp("vocabs"), {}

    def get(name):
        if name not in made:
            made[name] = SOURCES[name](root)
        return made[name]
    return get


@pytest.mark.parametrize("source", list(SOURCES))
def test_token_table_spells_what_the_tokenizer_encodes(tokenizers, source):
    tok = tokenizers(source)
    v = C.token_vocab(tok, tok.vocab_size)
    assert C.token_vocab(tok, tok.vocab_size) is v                     # built once per tokenizer
    assert set(tok.eos_ids) <= v.special and v.eos
    for text in TEXTS:
        ids = tok.encode(text, add_special=False, parse_special=False)
        spelled = b"".join(v.tokens[i] for i in ids)
        assert spelled in (text.encode(), b" " + text.encode())       # SentencePiece adds one space first
        assert not set(ids) & v.special
    if source.startswith("hf-"):                    # llguidance's own tokenizer.json reader as the reference
        ref = llg.LLTokenizer(tok.tok.tok.to_str())
        assert [ref.decode_bytes([i]) for i in range(v.n)] == v.tokens
        assert {i for i in range(v.n) if ref.is_special_token(i) and v.tokens[i]} <= v.special


@pytest.mark.parametrize("source", list(SOURCES))
def test_a_schema_walk_accepts_valid_json_and_refuses_the_rest(tokenizers, source):
    """Multi-byte characters split across byte tokens and merged tokens alike."""
    tok = tokenizers(source)
    v = C.token_vocab(tok, tok.vocab_size)
    grammar = C.json_schema_grammar(SCHEMA)
    jsonschema.validate(DOC, SCHEMA)
    good = C.compile_grammar(v, grammar)
    assert good.consume_tokens(v.tokenize(json.dumps(DOC, ensure_ascii=False).encode()))
    assert good.is_accepting() and C.Constraint(v, good).done
    bad = C.compile_grammar(v, grammar)
    ids = v.tokenize(json.dumps({**DOC, "city": "Zurich"}, ensure_ascii=False).encode())
    assert bad.validate_tokens(ids) < len(ids)


def test_a_vocabulary_without_eos_still_ends_when_the_grammar_is_complete():
    """32 ids (the mask is exactly one word) and no EOS: llguidance gets one past the vocabulary."""
    tokens = [b"{", b"}", b'"', b"a", b":", b" ", b","] + [bytes([c]) for c in b"bcdefghijklmnopqrstuvwxy"] + [b"z"]
    v = C.Vocab(tokens, frozenset(), (), {}, lambda text, special: [tokens.index(bytes([c])) for c in text.encode()])
    c = C.Constraint(v, C.compile_grammar(v, C.json_schema_grammar({"type": "object", "maxProperties": 0})))
    logits = torch.zeros(len(tokens))
    for want in (b"{", b"}"):
        masked = c(logits)
        assert torch.isfinite(masked).tolist() == [t == want for t in tokens]
        c.accept(tokens.index(want))
    assert c.done and c(logits) is logits
    fresh = C.Constraint(v, C.compile_grammar(v, C.json_schema_grammar({"type": "object", "maxProperties": 0})))
    twin = fresh.fork()
    fresh.accept(0)
    assert torch.isfinite(twin(logits)).tolist() == [t == b"{" for t in tokens] and not fresh.done


def test_qwen_xml_calls_follow_the_schema_and_parse_back(tokenizers):
    """Qwen3.5 / Qwen3-Coder: raw-text strings (enums enforced), JSON for other types."""
    tok = tokenizers("hf-qwen3")
    v, fmt = C.token_vocab(tok, tok.vocab_size), FORMATS["qwen-xml"]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "required": ["city"], "properties": {
            "city": {"type": "string"}, "unit": {"type": "string", "enum": ["°C", "°F"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 9}}}}}, TOOLS[1]]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    grammar = tool_grammar(fmt, tuple(enumerate(tools)), None, v)
    cases = [("get_weather", {"city": "New <York>", "days": 3}, True),
             ("get_weather", {"city": "Zürich", "unit": "°C"}, True),
             ("search", {"q": "日本 <b>"}, True), ("search", {}, False),
             ("get_weather", {"city": "Paris", "unit": "K"}, False), ("get_weather", {}, False)]
    for name, args, ok in cases:
        body = "".join(f"<parameter={k}>\n{v_}\n</parameter>\n" for k, v_ in args.items())
        m = C.compile_grammar(v, grammar)
        ids = v.encode(f"{name}>\n{body}</function>\n</tool_call>", True)
        assert (m.consume_tokens(ids) and m.is_stopped()) == ok, (name, args)
        if ok:
            assert fmt.parse(f"<function={name}>\n{body}</function>", schemas) == [(name, args)]


def test_strict_tools_under_auto_constrain_only_a_call_the_model_opens(tokenizers):
    from mawforge.front.structured import _open_token
    tok = tokenizers("hf-qwen3")                        # <tool_call> is one added (special) token
    v, fmt = C.token_vocab(tok, tok.vocab_size), FORMATS["qwen-json"]
    opener = _open_token(fmt, v)
    assert opener == tok.token_id("<tool_call>") and _open_token(FORMATS["llama3"], v) is None
    t = C.Triggered(opener, C.Constraint(v, C.compile_grammar(v, tool_grammar(fmt, tuple(enumerate(TOOLS)), None, v,
                                                                                lead="\n"))))
    logits = torch.zeros(v.n)
    for i in v.encode("Let me check. ", False):
        assert t(logits) is logits
        t.accept(i)
    t.accept(opener)
    call = '\n{"name": "get_weather", "arguments": {"city": "Zürich", "unit": "°C"}}\n</tool_call>'
    for i in v.encode(call, True):
        assert bool(torch.isfinite(t(logits))[i]) and not t.done
        t.accept(i)
    assert t.done
    t.rollback(len(v.encode(call, True)) + 1)            # back before the opener: free again
    assert t(logits) is logits and not t.done
    t.accept(opener)
    bad = v.encode('\n{"name": "get_weather", "arguments": {"city": "Zürich", "unit": "K"}}', True)
    allowed = []
    for i in bad:
        allowed.append(bool(torch.isfinite(t(logits))[i]))
        if not allowed[-1]:
            break
        t.accept(i)
    assert not all(allowed)


def test_each_json_call_format_is_the_prefix_plus_a_head_and_its_grammar_takes_a_call(tokenizers):
    v = C.token_vocab(tokenizers("hf-gpt_oss"), tokenizers("hf-gpt_oss").vocab_size)   # harmony specials
    args = {"city": "Zürich", "unit": "°C"}
    for name, (head, tail) in JSON_CALLS.items():
        fmt = FORMATS[name]
        assert fmt.prefix(None) + head("get_weather") == fmt.prefix("get_weather")
        forced = tuple(enumerate(TOOLS))
        for named, text in ((None, head("get_weather")), ("get_weather", "")):
            m = C.compile_grammar(v, tool_grammar(fmt, forced[:1] if named else forced, named, v))
            ids = v.encode(text + json.dumps(args, ensure_ascii=False) + tail, True)
            assert m.consume_tokens(ids) and m.is_stopped(), (name, named)


# ---- generation on the tiny fixture packs and the demo model ---------------------------------

@pytest.fixture(scope="module")
def runtimes(tmp_path_factory):
    root = tmp_path_factory.mktemp("structured")
    built = build_fixtures(root / "fx", archs=("qwen3_moe", "mixtral"), ftypes=("Q8_0",))
    packs = {"demo": demo_gguf("Q8_0"), "qwen3_moe-gguf": built["qwen3_moe"]["gguf"]["Q8_0"],
             "mixtral-gguf": built["mixtral"]["gguf"]["Q8_0"], "mixtral-hf": built["mixtral"]["hf"]}
    threads = torch.get_num_threads()
    made = {}
    for name, src in packs.items():
        pack(src, root / name, progress=False)
        made[name] = Runtime(root / name, RuntimeOptions(context=1024, budget=Budget(2 << 30, "test"), threads=1))
    yield made
    for rt in made.values():
        rt.close()
    torch.set_num_threads(threads)


def _constrained(rt, grammar: str):
    v = C.token_vocab(rt.tokenizer, rt.cfg.vocab)
    return C.Constraint(v, C.compile_grammar(v, grammar))


def _run(rt, prompt: str, grammar: str, speculative=None, **params):
    ids = rt.tokenizer.encode(prompt)
    evs = list(generate(rt, ids, SamplingParams(**params), processors=[_constrained(rt, grammar)],
                        speculative=speculative))
    return "".join(e.text for e in evs), [e.token for e in evs], evs[-1]


PROMPT = "<|im_start|>user\nDescribe a city as JSON.<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("name", ["demo", "qwen3_moe-gguf", "mixtral-gguf", "mixtral-hf"])
@pytest.mark.parametrize("temperature,seed", [(0.0, None), (0.9, 1), (1.2, 2)])
def test_json_schema_output_always_validates(runtimes, name, temperature, seed):
    text, _, last = _run(runtimes[name], PROMPT, C.json_schema_grammar(SCHEMA), max_tokens=120,
                              temperature=temperature, seed=seed)
    assert last.finish_reason == "stop" and "\ufffd" not in text
    jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_output_is_an_object(runtimes):
    """Any object: a weak model may keep a string going until max_tokens ("length"); whatever
    ends with "stop" is an object."""
    ends = []
    for temperature, seed in ((0.0, None), (0.7, 1), (0.7, 3), (0.5, 4)):
        text, _, last = _run(runtimes["demo"], PROMPT, C.json_schema_grammar({"type": "object"}), max_tokens=120,
                             temperature=temperature, seed=seed)
        ends.append(last.finish_reason)
        assert last.finish_reason in ("stop", "length") and "\ufffd" not in text
        if last.finish_reason == "stop":
            assert isinstance(json.loads(text), dict)
    assert ends[0] == "stop"


class _Forbidden(Drafter):
    """Drafts the plain output's next tokens, then one token no JSON grammar allows (a special)."""

    def __init__(self, truth: list[int], n_prompt: int, bad: int) -> None:
        super().__init__(None, None)
        self.truth, self.n_prompt, self.bad = truth, n_prompt, bad

    def propose(self, context, k):
        self.probs = None
        return self.truth[len(context) - self.n_prompt:][:k - 1] + [self.bad]


def test_drafts_the_grammar_forbids_are_rejected_and_sampled_drafts_stay_valid(runtimes):
    rt = runtimes["demo"]
    grammar, n_prompt = C.json_schema_grammar(SCHEMA), len(rt.tokenizer.encode(PROMPT))
    _, plain, _ = _run(rt, PROMPT, grammar, max_tokens=60, temperature=0.0)
    bad = rt.tokenizer.token_id("<|im_start|>")
    spec = Speculator(rt, SpecOptions(mode="ngram", k=4), _drafter=_Forbidden(plain, n_prompt, bad))
    same = _run(rt, PROMPT, grammar, speculative=spec, max_tokens=60, temperature=0.0)
    report = same[2].telemetry.speculative
    assert same[1] == plain and report["accepted"] < report["drafted"] and bad not in same[1]
    for seed in (1, 2):
        sampled = _run(rt, PROMPT, grammar, speculative=Speculator(rt, SpecOptions(mode="ngram", k=4)),
                       max_tokens=120, temperature=0.9, seed=seed)
        assert sampled[2].finish_reason == "stop"
        jsonschema.validate(json.loads(sampled[0]), SCHEMA)


def test_max_tokens_mid_structure_ends_with_length(runtimes):
    text, tokens, last = _run(runtimes["demo"], PROMPT, C.json_schema_grammar(SCHEMA), max_tokens=3)
    assert last.finish_reason == "length" and len(tokens) == 3 and text.startswith("{")


# ---- through the server, with the official openai client ------------------------------------

def _template(stem: str) -> str:
    from mawforge.fixtures.sdist_templates import SdistMissing, template_dir
    try:
        return (template_dir() / f"{stem}.jinja").read_text()
    except SdistMissing as e:
        pytest.skip(f"llama-cpp-python sdist not available: {e}")


@pytest.fixture(scope="module")
def served(runtimes):
    """The demo model behind Qwen3's chat template (hermes-style <tool_call>{json}</tool_call>)."""
    app = build_app(runtimes["demo"], "demo", max_tokens_default=120, chat_template=_template("Qwen-Qwen3-0.6B"),
                    allow_forced_output=True)
    with ServerThread(app) as s:
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)


ASK = [{"role": "user", "content": "What is the weather in Zürich?"}]
RF = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}


def test_response_format_through_the_server_streamed_and_not(served):
    for temperature in (0.0, 1.0):
        whole = served.chat.completions.create(model="demo", messages=ASK, response_format=RF,
                                               temperature=temperature, seed=5)
        chunks = list(served.chat.completions.create(model="demo", messages=ASK, response_format=RF,
                                                     temperature=temperature, seed=5, stream=True))
        deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
        assert whole.choices[0].finish_reason == chunks[-1].choices[0].finish_reason == "stop"
        assert "".join(deltas) == whole.choices[0].message.content and not any("\ufffd" in d for d in deltas)
        jsonschema.validate(json.loads(whole.choices[0].message.content), SCHEMA)
    obj = served.chat.completions.create(model="demo", messages=ASK, response_format={"type": "json_object"},
                                         temperature=0.0)
    assert obj.choices[0].finish_reason == "stop" and isinstance(json.loads(obj.choices[0].message.content), dict)
    text = served.chat.completions.create(model="demo", messages=ASK, response_format={"type": "text"}, max_tokens=4)
    assert text.choices[0].finish_reason == "length"


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"])
def test_forced_tool_calls_are_parseable_and_schema_valid(served, choice):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for temperature, seed in ((0.0, None), (1.0, 1), (1.3, 2)):
        r = served.chat.completions.create(model="demo", messages=ASK, tools=TOOLS, tool_choice=choice,
                                           temperature=temperature, seed=seed)
        (call,) = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and call.function.name in schemas
        if choice != "required":
            assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_speculative_ngram_equals_plain_through_the_server(served):
    outs = [served.chat.completions.create(model="demo", messages=ASK, response_format=RF, temperature=0.0,
                                           extra_body={"speculative": mode}) for mode in ("off", "ngram")]
    assert outs[0].choices[0].message.content == outs[1].choices[0].message.content
    assert outs[1].telemetry["speculative"]["mode"] == "ngram"


@pytest.mark.parametrize("extra,param", [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "pattern": "(((("}}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/no"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "enum": [f"value number {i}" for i in range(20000)]}}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {f"p{i}": {"type": "string", "pattern": f"^x{i}[a-z]{{3,9}}$"}
                                         for i in range(3000)}}}}}, "response_format"),
    ({"tools": TOOLS[:1] + [{"type": "function", "function": {"name": "bad", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(("}}}}}],
      "tool_choice": "required"}, "tools[1].function.parameters"),
])
def test_schemas_llguidance_refuses_are_400s_naming_the_field(served, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        served.chat.completions.create(model="demo", messages=ASK, max_tokens=4, extra_body=extra)
    assert e.value.status_code == 400 and e.value.body["param"] == param and "\n" not in e.value.body["message"]


def test_a_dead_end_keeps_what_streamed_and_tells_the_client(served):
    """forced_output (the testing hook) writes tokens the grammar refuses: the client sees an
    error in OpenAI's schema, never a 500 or a hang, and keeps what streamed before it."""
    forced = '{"city": "Berlin", "name": "x", "n": 1, "tags": []}'
    body = {"response_format": RF, "extra_body": {"forced_output": forced}}
    with pytest.raises(openai.BadRequestError) as e:
        served.chat.completions.create(model="demo", messages=ASK, **body)
    assert e.value.body["code"] == "grammar_dead_end"
    got = []
    with pytest.raises(openai.APIError) as e:
        for c in served.chat.completions.create(model="demo", messages=ASK, stream=True, **body):
            got.append(c.choices[0].delta.content or "" if c.choices else "")
    assert "".join(got).startswith('{"city": "') and forced.startswith("".join(got))
    assert "grammar" in str(e.value)
    short = served.chat.completions.create(model="demo", messages=ASK, response_format=RF, max_tokens=3)
    assert short.choices[0].finish_reason == "length"


def test_json_output_closes_a_reasoning_block_the_template_opens():
    """Qwen3.5's template leaves the answer inside <think>: JSON is the answer, so it is closed first."""
    from mawforge.text.chat import ChatTemplate
    from mawforge.front.chatreq import ChatFront, parse_chat_options
    front = ChatFront(ChatTemplate(_template("Qwen3.5-4B"), "", "<|im_end|>"))
    free = front.prepare(parse_chat_options({}, ASK))
    turn = front.prepare(parse_chat_options({"response_format": RF}, ASK))
    assert free.prompt.rstrip().endswith("<think>") and turn.prompt == free.prompt + "</think>\n\n"
    assert turn.parser.mode == "content"
