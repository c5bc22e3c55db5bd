"""Structured outputs at the API edge: the grammar a request's output must follow, compiled into
the engine's Constraint (engine/constraint.py, llguidance).

    proc = request_constraint(rt, req.response_format, turn)    # None, or a Constraint; 400s as ApiError
    generate(rt, ids, params, processors=[proc])

Three sources: `response_format` (protocol.parse_response_format's shape: json_object, json_schema);
a forced tool call (tool_choice "required" or a named function): chatreq.py writes the call's
opening into the prompt, and the grammar here forces the rest in the model's own call syntax, with
arguments matching the function's JSON Schema; and, under tool_choice "auto" with a `strict`
function, a call the model opens itself. A forced call wins over response_format, which wins
over the strict-auto one.
"""
from __future__ import annotations

from collections.abc import Callable

from mawforge.engine import constraint as C
from mawforge.front.protocol import ApiError
from mawforge.text.tools import ToolFormat

# Tool-call formats whose arguments are one JSON object: format -> (the call's head after the
# opening that tool_choice "required" writes, given the function name; the text that closes the
# call). fmt.prefix(None) + head(name) == fmt.prefix(name) (tests/test_structured.py checks it).
JSON_CALLS: dict[str, tuple[Callable[[str], str], str]] = {
    "qwen-json": (lambda n: f'{{"name": "{n}", "arguments": ', "}\n</tool_call>"),
    "llama3": (lambda n: f'{n}", "parameters": ', "}"),
    "mistral": (lambda n: f"{n}[ARGS]", ""),
    "mistral-json": (lambda n: f'{{"name": "{n}", "arguments": ', "}]"),
    "deepseek": (lambda n: f"{n}<｜tool▁sep｜>", "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
    "gpt-oss": (lambda n: f"{n} <|constrain|>json<|message|>", "<|call|>"),
}


CONSTRAINED = (*JSON_CALLS, "qwen-xml")     # the formats whose forced calls are constrained end to end


def response_grammar(fmt: dict | None) -> str | None:
    if fmt is None:
        return None
    if fmt["type"] == "json_object":
        return C.json_schema_grammar({"type": "object"})
    return C.json_schema_grammar(fmt["schema"], lenient=not fmt["strict"])


def _schema(tool: dict) -> tuple[dict, bool]:
    """A function's parameters schema and whether it is compiled leniently (not strict)."""
    fn = tool["function"]
    return fn.get("parameters") or {"type": "object"}, not fn.get("strict", False)


def tool_grammar(fmt: ToolFormat, forced: tuple, named: str | None, vocab: C.Vocab, lead: str = "") -> str | None:
    """The Lark grammar of what follows the call opening in the prompt (`lead`: text before the
    calls); None for a format that is not constrained (the opening alone forces the call)."""
    if not forced or fmt.name not in CONSTRAINED:
        return None
    if fmt.name == "qwen-xml":
        head, tail, body = (lambda n: f"{n}>\n"), "</function>\n</tool_call>", _xml_params
    else:
        (head, tail), body = JSON_CALLS[fmt.name], _json_args
    rules, alts = [], []
    for k, (_, tool) in enumerate(forced):
        parts = [] if named is not None else [vocab.literal(head(tool["function"]["name"]))]
        parts += [f"args_{k}"] + ([vocab.literal(tail)] if tail else [])
        rules += [f"call_{k}: {' '.join(parts)}"] + body(f"args_{k}", *_schema(tool), vocab)
        alts.append(f"call_{k}")
    start = f"start: {vocab.literal(lead)} ({' | '.join(alts)})" if lead else f"start: {' | '.join(alts)}"
    return C.lark_grammar("\n".join([start] + rules))


def _json_args(rule: str, schema: dict, lenient: bool, vocab: C.Vocab) -> list[str]:
    return [f"{rule}: {C.json_in_lark(schema, lenient)}"]


def _xml_params(rule: str, schema: dict, lenient: bool, vocab: C.Vocab) -> list[str]:
    """Qwen3.5 / Qwen3-Coder: one <parameter=KEY>\nVALUE\n</parameter>\n per property, in the
    schema's order, the required ones mandatory. A string is raw text (its enum enforced, not its
    length or pattern); any other value is compact JSON for its schema."""
    props, required = schema.get("properties") or {}, set(schema.get("required") or ())
    items, rules = [], []
    for j, (key, sub) in enumerate(props.items()):
        name = f"{rule}_{j}"
        sub = sub if isinstance(sub, dict) else {}
        close = vocab.literal("\n</parameter>")
        if sub.get("type") == "string" and "enum" in sub:
            value = "(" + " | ".join(vocab.literal(str(e)) for e in sub["enum"]) + f") {close}"
        elif sub.get("type") == "string":
            rules.append(f"{name}_text[lazy]: /(?s:.*)\\n<\\/parameter>/")
            value = f"{name}_text"
        else:
            value = f"{C.json_in_lark(sub, lenient)} {close}"
        rules.append(f"{name}: {vocab.literal(f'<parameter={key}>' + chr(10))} {value} {vocab.literal(chr(10))}")
        items.append(name if key in required else f"{name}?")
    return [f"{rule}: {' '.join(items) or chr(34) * 2}"] + rules


def _compile(vocab: C.Vocab, grammar: str, param: str) -> C.Constraint:
    try:
        return C.Constraint(vocab, C.compile_grammar(vocab, grammar))
    except C.GrammarError as e:
        raise ApiError(400, f"{param}: {e}", param=param, code="invalid_schema") from None


def _tool_culprit(vocab: C.Vocab, forced: tuple) -> str:
    """The first forced tool whose schema alone does not compile (the grammar of all did not)."""
    for i, tool in forced:
        schema, lenient = _schema(tool)
        try:
            C.compile_grammar(vocab, C.lark_grammar(f"start: {C.json_in_lark(schema, lenient)}"))
        except C.GrammarError:
            return f"tools[{i}].function.parameters"
    return "tools"


def _open_token(fmt: ToolFormat, vocab: C.Vocab) -> int | None:
    """The special token that opens this format's calls, if one token does."""
    if not fmt.open or not fmt.prefix(None).startswith(fmt.open[0]):
        return None
    ids = vocab.encode(fmt.open[0], True)
    return ids[0] if len(ids) == 1 and ids[0] in vocab.special else None


def strict_auto(rt, turn) -> C.Triggered | None:
    """tool_choice "auto" with a strict function: a call the model opens (with its format's single
    opening token) is constrained like a forced one, over every tool; text stays free."""
    tools = turn.offered if turn is not None else ()
    if not tools or not any(t["function"].get("strict") for t in tools) or turn.parser.fmt.name not in CONSTRAINED:
        return None
    fmt, vocab = turn.parser.fmt, C.token_vocab(rt.tokenizer, rt.cfg.vocab)
    trigger = _open_token(fmt, vocab)
    if trigger is None:
        return None
    forced = tuple(enumerate(tools))
    grammar = tool_grammar(fmt, forced, None, vocab, lead=fmt.prefix(None)[len(fmt.open[0]):])
    try:
        return C.Triggered(trigger, C.Constraint(vocab, C.compile_grammar(vocab, grammar)))
    except C.GrammarError as e:
        param = _tool_culprit(vocab, forced)
        raise ApiError(400, f"{param}: {e}", param=param, code="invalid_schema") from None


def request_constraint(rt, response_format: dict | None, turn) -> C.Constraint | C.Triggered | None:
    """The request's logits processor, or None when its output is free. Raises ApiError (400) naming
    `response_format` or `tools[i].function.parameters` when llguidance refuses the schema."""
    forced = turn.forced if turn is not None else ()
    if forced:
        fmt: ToolFormat = turn.parser.fmt
        if fmt.name not in CONSTRAINED:
            return None
        vocab = C.token_vocab(rt.tokenizer, rt.cfg.vocab)
        try:
            return C.Constraint(vocab, C.compile_grammar(vocab, tool_grammar(fmt, forced, turn.named, vocab)))
        except C.GrammarError as e:
            param = _tool_culprit(vocab, forced)
            raise ApiError(400, f"{param}: {e}", param=param, code="invalid_schema") from None
    if response_format is None:
        return strict_auto(rt, turn)
    vocab = C.token_vocab(rt.tokenizer, rt.cfg.vocab)
    try:
        grammar = response_grammar(response_format)
    except C.GrammarError as e:
        raise ApiError(400, f"response_format: {e}", param="response_format", code="invalid_schema") from None
    return _compile(vocab, grammar, "response_format")
