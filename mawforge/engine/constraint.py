"""Output constrained token by token by llguidance (the grammar engine llama.cpp and vLLM use).

    vocab = token_vocab(rt.tokenizer, rt.cfg.vocab)      # once per runtime (cached): each id's exact bytes
    proc = Constraint(vocab, compile_grammar(vocab, g))  # per request; GrammarError is a 400
    generate(rt, ids, params, processors=[proc])         # the mask runs before every sampling filter

`g` is llguidance's grammar text: `lark_grammar(...)` (Lark with `%json {schema}` inside) or
`json_schema_grammar(schema)`. The constraint is a sampling.LogitsProcessor: `accept` follows every
token the request emits and every draft speculative verification checks, `rollback` undoes them;
`done` says the grammar is complete (the generator ends the choice with "stop"); a state that
allows no token raises GrammarDeadEnd after what was emitted has streamed.
Legend: V vocabulary (logits) size, W = ceil(V / 32) mask words.
"""
from __future__ import annotations

import json
import threading
import weakref
from dataclasses import dataclass, field

import llguidance as llg
import numpy as np
import torch

from mawforge.text import pretok
from mawforge.text.llama_vocab import CONTROL, UNKNOWN, UNUSED, USER_DEFINED, GgufVocab
from mawforge.errors import RequestError, UnsupportedError

MAX_GRAMMAR_CHARS = 256 * 1024        # a schema or grammar text larger than this is refused unread
# llguidance's own bounds on compiling and on each step (its defaults allow ~500 MB of lexer states)
LIMITS = {"max_items_in_row": 2000, "initial_lexer_fuel": 1_000_000, "step_lexer_fuel": 200_000,
          "step_max_items": 50_000, "max_lexer_states": 50_000, "max_grammar_size": 20_000, "verbose_errors": False}
# Output JSON as models usually write it (json.dumps's separators), without free whitespace, which
# a weak model could otherwise repeat until max_tokens.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_NEG_INF = torch.tensor(float("-inf"))


class GrammarError(RequestError):
    """A grammar or schema llguidance cannot compile, or one past the limits."""


class GrammarDeadEnd(RequestError):
    """The grammar allows no next token (or rejected an emitted one)."""
    code = "grammar_dead_end"


def limits() -> llg.LLParserLimits:
    return llg.LLParserLimits(**LIMITS)


@dataclass
class Vocab:
    """Every token id's exact bytes (special tokens marked) and llguidance's tokenizer over them."""
    tokens: list[bytes]                   # [V]
    special: frozenset[int]
    eos: tuple[int, ...]
    text_of: dict[int, str]               # special id -> its text (to find it in a literal)
    encode: object                        # (text, parse_special) -> ids: the runtime's tokenizer
    ll: llg.LLTokenizer = field(init=False)

    def __post_init__(self) -> None:
        self.by_bytes = {b: i for i, b in reversed(list(enumerate(self.tokens))) if b and i not in self.special}
        self.longest = max(map(len, self.by_bytes), default=1)
        table = _Table(self)
        if not self.eos:                  # llguidance needs an EOS id: one past the vocabulary, never sampled
            table.tokens = self.tokens + [b""]
            table.special_token_ids.append(len(self.tokens))
        table.eos_token_id = (self.eos or (len(self.tokens),))[0]
        self.ll = llg.LLTokenizer(llg.TokenizerWrapper(table), eos_token=list(self.eos) or [table.eos_token_id])

    @property
    def n(self) -> int:
        return len(self.tokens)

    def tokenize(self, data: bytes) -> list[int]:
        """The runtime's ids when they spell `data` exactly, else a greedy longest-match split."""
        ids = self.encode(data.decode("utf-8", errors="replace"), False)
        if b"".join(self.tokens[i] for i in ids) == data:
            return ids
        out, i = [], 0
        while i < len(data):
            for j in range(min(len(data), i + self.longest), i, -1):
                t = self.by_bytes.get(data[i:j])
                if t is not None:
                    out.append(t)
                    i = j
                    break
            else:
                i += 1                    # a byte no token spells: llguidance never forces it
        return out

    def literal(self, text: str) -> str:
        """A Lark expression that matches `text`, each special token in it as that token (`<[id]>`)."""
        parts, at = [], 0
        for i in self.encode(text, True):
            if i not in self.special:
                continue
            t = self.text_of[i]
            j = text.find(t, at)
            if j < 0:
                continue
            if j > at:
                parts.append(json.dumps(text[at:j], ensure_ascii=False))
            parts.append(f"<[{i}]>")
            at = j + len(t)
        if at < len(text):
            parts.append(json.dumps(text[at:], ensure_ascii=False))
        return " ".join(parts) or '""'


class _Table:
    """What llguidance.TokenizerWrapper reads: tokens, special ids, eos/bos, and a tokenize call."""

    def __init__(self, v: Vocab):
        self.tokens, self.special_token_ids = v.tokens, sorted(v.special)
        self.eos_token_id, self.bos_token_id, self.v = None, None, v

    def __call__(self, data: bytes) -> list[int]:
        return self.v.tokenize(data if isinstance(data, bytes) else data.encode())


def _gguf_bytes(vocab: GgufVocab) -> tuple[list[bytes], set[int]]:
    """token_to_piece bytes; control, unknown and unused ids, and user-defined `<...>` markers are
    special (as llguidance's own llama.cpp adapter marks them; token_vocab adds the empty ones)."""
    tokens, special = [], set()
    for i in range(len(vocab.tokens)):
        b, a = vocab.piece(i), vocab.attrs[i]
        if a & (CONTROL | UNKNOWN | UNUSED) or (a & USER_DEFINED and b.startswith(b"<") and b.endswith(b">")):
            special.add(i)
        tokens.append(b)
    return tokens, special


def _decoder_kinds(d: dict | None) -> set[str]:
    if not d:
        return set()
    return {d.get("type", "")} | {k for x in d.get("decoders") or () for k in _decoder_kinds(x)}


def _hf_bytes(tok) -> tuple[list[bytes], set[int]]:
    """A tokenizer.json vocabulary: byte-level (GPT-2 byte-to-unicode) or SentencePiece style
    (U+2581 for space, <0xHH> byte fallback); added tokens are special, spelled as their text."""
    kinds = _decoder_kinds(json.loads(tok.to_str()).get("decoder"))
    byte_level = "ByteLevel" in kinds
    if not byte_level and not kinds & {"Metaspace", "Replace", "ByteFallback"}:
        raise UnsupportedError(f"structured output needs a byte-level or SentencePiece-style tokenizer.json "
                               f"(its decoder is {sorted(kinds) or 'none'})")
    n = tok.get_vocab_size(with_added_tokens=True)
    tokens, special = [b""] * n, set(range(n))
    for text, i in tok.get_vocab(with_added_tokens=False).items():
        if byte_level:
            b = bytes(pretok.UNICODE_TO_BYTE[c] for c in text) if all(c in pretok.UNICODE_TO_BYTE for c in text) \
                else text.encode()
        elif len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
            b = bytes([int(text[3:5], 16)])
        else:
            b = text.replace("\u2581", " ").encode()
        tokens[i] = b
        special.discard(i)
    for i, added in tok.get_added_tokens_decoder().items():
        tokens[i] = added.content.encode()        # special, as llguidance's own tokenizer.json reader has it
        special.add(i)
    return tokens, special


_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def token_vocab(tokenizer, n_vocab: int) -> Vocab:
    """The Vocab of an engine TextTokenizer with `n_vocab` logits (ids past the tokenizer are
    never allowed), built once per tokenizer."""
    with _LOCK:
        got = _CACHE.get(tokenizer)
        if got is not None and got.n == max(n_vocab, len(got.tokens)):
            return got
        inner = tokenizer.tok
        tokens, special = _gguf_bytes(inner) if isinstance(inner, GgufVocab) else _hf_bytes(inner.tok)
        # 0xFF never occurs in UTF-8 and is llguidance's special-token marker: such a token is never text
        tokens = [b"" if b.startswith(b"\xff") else b for b in tokens]
        special |= {i for i, b in enumerate(tokens) if not b}
        if len(tokens) < n_vocab:
            special |= set(range(len(tokens), n_vocab))
            tokens = tokens + [b""] * (n_vocab - len(tokens))
        text_of = {i: tokens[i].decode("utf-8", errors="replace") for i in special}
        ref = weakref.ref(tokenizer)      # the cache holds the tokenizer weakly: no cycle through its value
        encode = lambda s, special: ref().encode(s, add_special=False, parse_special=special)
        v = Vocab(tokens, frozenset(special), tuple(sorted(e for e in tokenizer.eos_ids if e < len(tokens))),
                  text_of, encode)
        _CACHE[tokenizer] = v
        return v


def json_schema_grammar(schema: dict, lenient: bool = False) -> str:
    """llguidance grammar text for JSON matching `schema` (JSON_OPTIONS spacing)."""
    try:
        return llg.LLMatcher.grammar_from_json_schema(schema, overrides={**JSON_OPTIONS, "lenient": lenient})
    except ValueError as e:
        raise GrammarError(f"the schema is not valid: {_first_line(e)}") from None


def json_in_lark(schema: dict, lenient: bool = False) -> str:
    """A `%json` block for a Lark grammar: the schema with JSON_OPTIONS as its x-guidance."""
    return "%json " + json.dumps({**schema, "x-guidance": {**JSON_OPTIONS, "lenient": lenient}}, ensure_ascii=False)


def lark_grammar(lark: str) -> str:
    return llg.LLMatcher.grammar_from_lark(lark)


def compile_grammar(vocab: Vocab, grammar: str) -> llg.LLMatcher:
    """A fresh matcher for one request; GrammarError when llguidance refuses the grammar or it
    passes the LIMITS (compile time and lexer memory are bounded by them)."""
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"the grammar is {len(grammar)} characters; the limit is {MAX_GRAMMAR_CHARS}")
    m = llg.LLMatcher(vocab.ll, grammar, log_level=0, limits=limits())
    if m.is_error():
        raise GrammarError(f"the grammar does not compile: {_first_line(m.get_error())}")
    return m


def _first_line(e) -> str:
    """llguidance's message on one line (its regex errors span several)."""
    s = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
    return (s or type(e).__name__)[:300]


class Constraint:
    """One request's grammar as a LogitsProcessor: disallowed tokens get -inf logits."""

    def __init__(self, vocab: Vocab, matcher: llg.LLMatcher):
        self.vocab, self.m = vocab, matcher
        self.bits = torch.zeros((vocab.ll.vocab_size + 31) // 32, dtype=torch.int32)     # [W]
        self.n_accepted = 0
        self.past = 0        # tokens accepted after the grammar completed (speculative drafts)

    @property
    def done(self) -> bool:
        return self.m.is_stopped() and not self.m.is_error()

    def fork(self) -> Constraint:
        """An independent copy in the same state (one per choice when a prompt has several)."""
        c = Constraint(self.vocab, self.m.deep_copy())
        c.n_accepted, c.past = self.n_accepted, self.past
        return c

    def disallowed(self) -> torch.Tensor:
        """The ids the grammar forbids at the next position, bool [V]. Raises GrammarDeadEnd."""
        self.m.unsafe_compute_mask_ptr(self.bits.data_ptr(), self.bits.numel() * 4)
        if self.m.is_error():
            raise GrammarDeadEnd(f"the output grammar failed after {self.n_accepted} tokens: "
                                 f"{_first_line(self.m.get_error())}")
        words = self.bits.numpy().view(np.uint8)                            # [4W], shares memory
        if not words.any():
            raise GrammarDeadEnd(f"the output grammar allows no next token after {self.n_accepted} tokens")
        return torch.from_numpy(np.unpackbits(~words, bitorder="little")[:self.vocab.n].view(np.bool_))

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.done and not self.vocab.eos:
            return logits
        forbid = self.disallowed()[:logits.shape[-1]].to(logits.device)
        if self.vocab.n > logits.shape[-1] and bool(forbid.all()):
            raise GrammarDeadEnd(f"the output grammar allows no next token after {self.n_accepted} tokens")
        return torch.where(forbid, _NEG_INF.to(logits.device, logits.dtype), logits)

    def accept(self, token: int) -> None:
        if self.done and token not in self.vocab.eos:
            self.past += 1
            return
        if not self.m.consume_token(token):
            raise GrammarDeadEnd(f"token {token} does not fit the output grammar after {self.n_accepted} tokens")
        self.n_accepted += 1

    def rollback(self, n: int) -> None:
        k = min(n, self.past)
        self.past -= k
        if n - k:
            self.m.rollback(n - k)
            self.n_accepted -= n - k


class Triggered:
    """Free output until the model emits `trigger` (a call's opening token), then `inner`'s grammar
    (tool_choice "auto" with strict functions). A LogitsProcessor too; rollback across the trigger
    frees the output again."""

    def __init__(self, trigger: int, inner: Constraint):
        self.trigger, self.inner = trigger, inner
        self.n, self.at = 0, None            # tokens accepted; how many there were when the trigger came

    @property
    def done(self) -> bool:
        return self.at is not None and self.inner.done

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return logits if self.at is None else self.inner(logits)

    def accept(self, token: int) -> None:
        self.n += 1
        if self.at is not None:
            self.inner.accept(token)
        elif token == self.trigger:
            self.at = self.n

    def fork(self) -> Triggered:
        """An independent copy in the same state (one per choice)."""
        t = Triggered(self.trigger, self.inner.fork())
        t.n, t.at = self.n, self.at
        return t

    def rollback(self, n: int) -> None:
        if self.at is not None:
            inside = self.n - self.at                  # tokens the inner grammar accepted
            self.inner.rollback(min(n, inside))
            if n > inside:
                self.at = None
        self.n -= n
