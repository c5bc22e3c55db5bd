"""llama.cpp's hand-written pre-tokenizer splitters (src/unicode.cpp), chosen, as there, when a
regex string equals the one each stands for. Each walks one piece [ini, end) of the text with
llama.cpp's codepoint flags `fl` (positions outside the piece have no flags) and appends the
lengths of the words it cuts to `out`."""
from __future__ import annotations

# llama.cpp's codepoint category flags (unicode.h); WS is its separate whitespace flag.
UNDEF, NUM, LET, SEP, MARK, PUNCT, SYM, CTRL = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20, 0x40, 0x80
WS = 0x100


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


def _whitespace_end(cp: str, F, pos: int, end: int) -> int:
    """Where llama.cpp's `\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+` ends a whitespace run at pos (one
    character on if none): through the last newline of the run, else all but the last space
    before a non-space, else the whole run."""
    n_ws, last_rn = 0, 0
    while F(pos + n_ws) & WS:
        if cp[pos + n_ws] in "\r\n":
            last_rn = pos + n_ws + 1
        n_ws += 1
    if last_rn:
        return last_rn
    if n_ws > 1 and pos + n_ws < end:
        return pos + n_ws - 1
    return pos + (n_ws or 1)


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
            pos = _whitespace_end(cp, F, pos, end)
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


_HAN = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F), (0x2B740, 0x2B81F),
        (0x2B820, 0x2CEAF), (0x2CEB0, 0x2EBEF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F))


def _is_han(c: str) -> bool:
    o = ord(c)
    return any(lo <= o <= hi for lo, hi in _HAN)


def _split_kimi_k2(cp: str, fl: list[int], ini: int, end: int, out: list[int]) -> None:
    """Kimi-K2's pattern set (tokenization_kimi.py), as llama.cpp hand-codes it for "\\p{Han}+":
    Han runs, letter words with an optional leading mark and contraction, \\p{N}{1,3}, then GPT-4-style
    punctuation and whitespace rules."""
    F = lambda p: fl[p] if ini <= p < end else 0                       # noqa: E731
    C = lambda p: cp[p] if ini <= p < end else ""                      # noqa: E731
    han = lambda p: ini <= p < end and _is_han(cp[p])                  # noqa: E731
    pos, prev = ini, ini

    def emit(at: int) -> None:
        nonlocal prev
        if at > prev:
            out.append(at - prev)
        prev = at
    while pos < end:
        c, f = cp[pos], fl[pos]
        if _is_han(c):
            while han(pos):
                pos += 1
            emit(pos)
            continue
        plain = not (c in "\r\n" or f & (LET | NUM))
        if (f & LET and not _is_han(c)) or (plain and F(pos + 1) & LET and not han(pos + 1)):
            lead = plain
            pos += lead
            letters = False
            while F(pos) & LET and not han(pos):
                letters, pos = True, pos + 1
            if letters or (not lead and F(pos) & LET and not han(pos)):
                if not letters:
                    pos += 1
                while F(pos) & LET and not han(pos):
                    pos += 1
                if C(pos) == "'" and pos + 1 < end:
                    n = cp[pos + 1].lower() if cp[pos + 1] < "\x80" else cp[pos + 1]
                    if n in "stmd":
                        pos += 2
                    elif pos + 2 < end:
                        nn = cp[pos + 2].lower() if cp[pos + 2] < "\x80" else cp[pos + 2]
                        if n + nn in ("re", "ve", "ll"):
                            pos += 3
                emit(pos)
                continue
            if lead:
                pos -= 1
        if f & NUM:
            run = pos
            while F(pos) & NUM:
                pos += 1
                if pos - run >= 3:
                    emit(pos)
                    run = pos
            emit(pos)
            continue
        f2 = F(pos + 1) if c == " " else f
        if not f2 & (WS | LET | NUM) and f2:
            pos += c == " "
            while F(pos) and not F(pos) & (WS | LET | NUM):
                pos += 1
            while C(pos) in ("\r", "\n"):
                pos += 1
            emit(pos)
            continue
        pos = _whitespace_end(cp, F, pos, end)
        emit(pos)


def _split_afmoe_digits(cp: str, fl: list[int], ini: int, end: int, out: list[int]) -> None:
    """AFMoE's (and tiny_aya's) digit grouping: a run of n digits is cut as n % 3 leading digits, then
    threes; the text before a run stays attached to its first group, as in llama.cpp."""
    pos, prev = ini, ini
    while pos < end:
        if fl[pos] & NUM:
            start = pos
            while pos < end and fl[pos] & NUM:
                pos += 1
            cut = start + (pos - start) % 3
            for at in ([cut] if cut > start else []) + list(range(cut + 3, pos + 1, 3)):
                if at > prev:
                    out.append(at - prev)
                prev = at
            continue
        pos += 1
    if prev < end:
        out.append(end - prev)


_LLAMA3 = ("(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|"
           "\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
CUSTOM = {
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)": _split_gpt2,
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
    "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+": _split_llama3_like(3, False),
    _LLAMA3: _split_llama3_like(3, False),
    _LLAMA3.replace("\\p{N}{1,3}", "\\p{N}"): _split_llama3_like(1, False),
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}|"
    " ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+": _split_llama3_like(1, True),
    "[^\\n]+|[\\n]+": _split_newlines,
    "\\p{Han}+": _split_kimi_k2,
    "\\p{AFMoE_digits}": _split_afmoe_digits,
    "\\d{1,3}(?=(?:\\d{3})*\\b)": _split_afmoe_digits,
}
