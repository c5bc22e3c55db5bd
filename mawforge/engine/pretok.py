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

from mawforge.engine import unicode_table

# llama.cpp's codepoint category flags (unicode.h); WS is its separate whitespace flag.
UNDEF, NUM, LET, SEP, MARK, PUNCT, SYM, CTRL = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20, 0x40, 0x80
WS = 0x100
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


# ------------------------------------------------------------------ hand-written splitters
def _split_gpt2(cp: str, fl: list[int], ini: int, end: int, out: list[int]) -> None:
    """'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S), as llama.cpp runs it."""
    F = lambda p: fl[p] if ini <= p < end else 0   # noqa: E731
    pos = ini
    while pos < end:
        c, f = cp[pos], fl[pos]
        start = pos
        if c == "'" and pos + 1 < end:
            n = cp[pos + 1]
            if n in "stmd":
                pos += 2
                out.append(pos - start)
                continue
            if pos + 2 < end and n + cp[pos + 2] in ("re", "ve", "ll"):
                pos += 3
                out.append(pos - start)
                continue
        f2 = F(pos + 1) if c == " " else f
        for cls in (LET, NUM):
            if f2 & cls:
                pos += c == " "
                while F(pos) & cls:
                    pos += 1
                break
        else:
            if not f2 & (WS | LET | NUM) and f2:
                pos += c == " "
                while F(pos) and not F(pos) & (WS | LET | NUM):
                    pos += 1
            else:
                n_ws = 0
                while F(pos + n_ws) & WS:
                    n_ws += 1
                if n_ws > 1 and pos + n_ws < end:
                    pos += n_ws - 1
                elif n_ws > 0:
                    pos += n_ws
                else:
                    pos += 1
        out.append(pos - start)


def _split_llama3_like(digits: int, marks: bool):
    """The Llama 3 (digits=3), Qwen2 (digits=1) and Qwen3.5 (digits=1, marks join letters) splitter:
    (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,n}|
    ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"""
    letter = LET | (MARK if marks else 0)

    def split(cp: str, fl: list[int], ini: int, end: int, out: list[int]) -> None:
        F = lambda p: fl[p] if ini <= p < end else 0   # noqa: E731
        pos = ini
        while pos < end:
            c, f = cp[pos], fl[pos]
            start = pos
            if c == "'" and pos + 1 < end:
                n = cp[pos + 1].lower() if cp[pos + 1] < "\x80" else cp[pos + 1]
                if n in "stmd":
                    pos += 2
                    out.append(2)
                    continue
                if pos + 2 < end:
                    nn = cp[pos + 2].lower() if cp[pos + 2] < "\x80" else cp[pos + 2]
                    if n + nn in ("re", "ve", "ll"):
                        pos += 3
                        out.append(3)
                        continue
            if not (c in "\r\n" or f & NUM) and (f & letter or F(pos + 1) & letter):
                pos += 1
                while F(pos) & letter:
                    pos += 1
                out.append(pos - start)
                continue
            if f & NUM:
                run = pos
                while F(pos) & NUM:
                    pos += 1
                    if pos - run >= digits:
                        out.append(pos - run)
                        run = pos
                if pos > run:
                    out.append(pos - run)
                continue
            f2 = F(pos + 1) if c == " " else f
            if not f2 & (WS | letter | NUM) and f:
                pos += c == " "
                while F(pos) and not F(pos) & (WS | letter | NUM):
                    pos += 1
                while pos < end and cp[pos] in "\r\n":
                    pos += 1
                out.append(pos - start)
                continue
            n_ws, last_rn = 0, 0
            while F(pos + n_ws) & WS:
                if cp[pos + n_ws] in "\r\n":
                    last_rn = pos + n_ws + 1
                n_ws += 1
            if last_rn:
                pos = last_rn
            elif n_ws > 1 and pos + n_ws < end:
                pos += n_ws - 1
            elif n_ws:
                pos += n_ws
            else:
                pos += 1
            out.append(pos - start)
    return split


def _split_newlines(cp: str, fl: list[int], ini: int, end: int, out: list[int]) -> None:
    """[^\\n]+|[\\n]+ (Gemma 4, Sarvam, Laguna)."""
    pos = ini
    while pos < end:
        start, nl = pos, cp[pos] == "\n"
        while pos < end and (cp[pos] == "\n") == nl:
            pos += 1
        out.append(pos - start)


_LLAMA3 = ("(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|"
           "\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
_CUSTOM = {
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)": _split_gpt2,
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
    "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+": _split_llama3_like(3, False),
    _LLAMA3: _split_llama3_like(3, False),
    _LLAMA3.replace("\\p{N}{1,3}", "\\p{N}"): _split_llama3_like(1, False),
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}|"
    " ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+": _split_llama3_like(1, True),
    "[^\\n]+|[\\n]+": _split_newlines,
}


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
        custom = _CUSTOM.get(expr)
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
