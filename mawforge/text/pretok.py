"""llama.cpp's pre-tokenizer (unicode_regex_split in src/unicode.cpp), reproduced so that a GGUF
vocabulary splits text into exactly the words llama.cpp feeds to its BPE merges.

Why not one `regex` pattern per vocabulary: llama.cpp does not run the tokenizer.json regex. It
applies a list of regexes in turn, each splitting the pieces the previous one left (matched and
unmatched spans both become pieces); it runs four common patterns (GPT-2, Llama 3, Qwen2,
Qwen3.5) through hand-written splitters, and every other pattern through std::regex on a
"collapsed" string in which each non-ASCII codepoint is replaced by one byte standing for its
class (letter, number, punctuation, mark, symbol, other; non-ASCII whitespace becomes \\v), with
\\p{..} in the pattern rewritten to the same bytes. Digits next to non-ASCII text, marks and
unassigned codepoints all split differently from a Unicode regex engine, so the same steps are
reproduced here, with llama.cpp's own codepoint table (unicode_table.py).
"""
from __future__ import annotations

import base64
import functools
import re
import zlib
from array import array

from mawforge.text import unicode_table
from mawforge.text.pretok_splitters import CUSTOM, LET, MARK, NUM, PUNCT, SYM, WS

_COLLAPSED = {NUM: "\xd1", LET: "\xd2", PUNCT: "\xd3", MARK: "\xd4", SYM: "\xd5"}
_UCAT = {"\\p{N}": NUM, "\\p{L}": LET, "\\p{P}": PUNCT, "\\p{M}": MARK, "\\p{S}": SYM,
         "\\p{Lu}": LET, "\\p{Ll}": LET, "\\p{Lt}": LET, "\\p{Lm}": LET, "\\p{Lo}": LET}
_UCAT_ASCII = {NUM: "\x30-\x39", LET: "\x41-\x5A\x61-\x7A",
               PUNCT: "\x21-\x23\x25-\x2A\x2C-\x2F\x3A-\x3B\x3F-\x40\\\x5B-\\\x5D\x5F\\\x7B\\\x7D",
               MARK: "", SYM: "\\\x24\\\x2B\x3C-\x3E\x5E\x60\\\x7C\\\x7E"}


@functools.lru_cache(maxsize=1)
def _flags() -> array:
    """Flags of every codepoint (uint16, 0x110000 entries), built once from the range table."""
    ranges = array("I")
    ranges.frombytes(zlib.decompress(base64.b64decode("".join(unicode_table.RANGES))))
    flags = array("H", bytes(2 * 0x110000))
    for i in range(0, len(ranges) - 2, 2):
        lo, f, hi = ranges[i], ranges[i + 1], ranges[i + 2]
        flags[lo:hi] = array("H", [f]) * (hi - lo)
    for cp in unicode_table.WHITESPACE:
        flags[cp] |= WS
    return flags


def cpt_flags(text: str) -> list[int]:
    fl = _flags()
    return [fl[ord(c)] for c in text]


# ------------------------------------------------------------------ std::regex emulation
def _ecma_to_python(expr: str) -> str:
    """ECMAScript `$` is end of input only; Python's also matches before a final newline."""
    out, inside, i = [], False, 0
    while i < len(expr):
        ch = expr[i]
        if ch == "\\":
            out.append(expr[i:i + 2])
            i += 2
            continue
        if ch == "[":
            inside = True
        elif ch == "]":
            inside = False
        out.append("\\Z" if ch == "$" and not inside else ch)
        i += 1
    return "".join(out)


def _collapse_regex(expr: str) -> str:
    """llama.cpp's rewrite of \\p{..} into the collapsed class bytes plus their ASCII members."""
    out, inside, i = [], False, 0
    while i < len(expr):
        ch = expr[i]
        if ch == "[" and (i == 0 or expr[i - 1] != "\\"):
            out.append("[")
            inside = True
        elif inside and ch == "]" and expr[i - 1] != "\\":
            out.append("]")
            inside = False
        elif expr.startswith("\\p{", i) and i + 3 < len(expr):
            close = expr.find("}", i + 3)
            cat = _UCAT.get(expr[i:close + 1]) if 0 <= close <= i + 10 else None
            if cat is None:
                out.append(ch)
                i += 1
                continue
            body = _COLLAPSED[cat] + _UCAT_ASCII[cat]
            out.append(body if inside else f"[{body}]")
            i = close
        else:
            out.append(ch)
        i += 1
    return "".join(out)


@functools.lru_cache(maxsize=None)
def _compiled(expr: str) -> tuple[re.Pattern, bool]:
    collapsed = any(u in expr for u in _UCAT)
    if collapsed and any(ord(c) >= 128 for c in expr):
        raise ValueError("regex mixes unicode categories and non-ASCII characters")
    body = _collapse_regex(expr) if collapsed else expr
    return re.compile(_ecma_to_python(body), re.ASCII), collapsed


def _split_stl(text: str, pattern: re.Pattern, offsets: list[int]) -> list[int]:
    out, start = [], 0
    for n in offsets:
        sub, idx = text[start:start + n], 0
        for m in pattern.finditer(sub):
            if m.start() > idx:
                out.append(m.start() - idx)
            out.append(m.end() - m.start())
            idx = m.end()
        if idx < n:
            out.append(n - idx)
        start += n
    return out


def regex_split(text: str, exprs: tuple[str, ...]) -> list[str]:
    """unicode_regex_split without the byte encoding: the words, in order, that cover `text`."""
    fl = cpt_flags(text)
    offsets = [len(text)]
    views: dict[bool, str] = {}
    for expr in exprs:
        custom = CUSTOM.get(expr)
        if custom is not None:
            out: list[int] = []
            start = 0
            for n in offsets:
                custom(text, fl, start, start + n, out)
                start += n
            offsets = out
            continue
        pattern, collapsed = _compiled(expr)
        if collapsed not in views:
            views[collapsed] = _collapsed_text(text, fl) if collapsed else _wide_text(text, fl)
        offsets = _split_stl(views[collapsed], pattern, offsets)
    words, start = [], 0
    for n in offsets:
        words.append(text[start:start + n])
        start += n
    return words


def _collapsed_text(text: str, fl: list[int]) -> str:
    return "".join(c if c < "\x80" else "\x0b" if f & WS else _COLLAPSED.get(f & 0xFF, "\xd0")
                   for c, f in zip(text, fl))


def _wide_text(text: str, fl: list[int]) -> str:
    return "".join("\x0b" if c >= "\x80" and f & WS else c for c, f in zip(text, fl))


# GPT-2 bytes_to_unicode: printable bytes map to themselves, the rest to U+0100.. in order.
def _byte_map() -> list[str]:
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, n = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + n)
            n += 1
    return [table[b] for b in range(256)]


BYTE_TO_UNICODE = _byte_map()
UNICODE_TO_BYTE = {c: b for b, c in enumerate(BYTE_TO_UNICODE)}


def byte_encode(word: str) -> str:
    return "".join(BYTE_TO_UNICODE[b] for b in word.encode("utf-8", "surrogatepass"))
