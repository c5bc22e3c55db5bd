"""GGUF tokenizers against llama.cpp: every generative ggml-vocab-*.gguf of the pinned sdist
tokenizes each of its .inp/.out vectors exactly (as tests/test-tokenizer-0.cpp runs them: no BOS,
special tokens not parsed), agrees with llama.cpp's own tokenizer (vocab_only, in a child process)
on seeded random strings of mixed scripts, digits, emoji, whitespace runs and code, decodes back
to its input, and streams text without splitting a UTF-8 character."""
from __future__ import annotations

import random

import pytest

from mawforge.text import pretok
from mawforge.text.llama_vocab import GgufVocab
from mawforge.text.pretok_table import PRE_NAMES, REGEXES
from mawforge.text.tokenizer import Detokenizer, from_gguf_metadata
from mawforge.errors import MawError, UnsupportedError
from mawforge.fixtures.llama_vocabs import (EMBEDDING_ONLY, llama_tokenize_many, read_vectors, vocab_dir,
                                            vocab_files, with_pre)
from mawforge.formats.gguf import read_header

GENERATIVE = ("aquila", "baichuan", "command-r", "deepseek-coder", "deepseek-llm", "falcon", "gemma-4",
              "gpt-2", "gpt-neox", "llama-bpe", "llama-spm", "mpt", "phi-3", "qwen2", "qwen35", "refact",
              "starcoder")
N_RANDOM = 120


@pytest.fixture(scope="session")
def vocab_root():
    return vocab_dir()


@pytest.fixture(scope="session")
def metas(vocab_root) -> dict:
    return {f.name[len("ggml-vocab-"):-len(".gguf")]: read_header(f)[0] for f in vocab_files(vocab_root)}


@pytest.fixture(scope="session")
def vocabs(metas) -> dict:
    return {name: from_gguf_metadata(meta) for name, meta in metas.items()}


def test_the_sdist_holds_the_vocabularies_named_here(vocab_root):
    names = {f.name[len("ggml-vocab-"):-len(".gguf")] for f in vocab_files(vocab_root, generative=False)}
    assert names == set(GENERATIVE) | set(EMBEDDING_ONLY)


@pytest.mark.parametrize("name", GENERATIVE)
def test_vectors_exact_and_round_trip(name, vocab_root, vocabs):
    tok = vocabs[name]
    for text, expected in read_vectors(vocab_root / f"ggml-vocab-{name}.gguf"):
        assert tok.encode(text, add_special=False, parse_special=False) == expected, text
        assert tok.decode(expected) == text, text


@pytest.mark.parametrize("name", EMBEDDING_ONLY)
def test_embedding_only_vocabularies_are_refused_in_one_line(name, vocab_root):
    meta = read_header(vocab_root / f"ggml-vocab-{name}.gguf")[0]
    with pytest.raises(UnsupportedError) as e:
        from_gguf_metadata(meta)
    assert "\n" not in str(e.value) and "embedding" in str(e.value)


def test_unknown_tokenizer_types_are_one_line_errors(metas):
    for key, value in (("tokenizer.ggml.model", "rwkv-9"), ("tokenizer.ggml.pre", "no-such-pre")):
        with pytest.raises(MawError) as e:
            GgufVocab(dict(metas["qwen2"], **{key: value}))
        assert value in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------------------- random strings
SCRIPTS = ["Hello", "world", "Straße", "naïve", "café", "Привет", "мир", "Γειά", "σου", "مرحبا", "שלום",
           "नमस्ते", "สวัสดี", "안녕하세요", "你好世界", "日本語のテキスト", "ありがとう", "ᐊᐃᓐᓇᐅ", "ẞ", "e\u0301", "ǅ"]
DIGITS = ["0", "7", "42", "1234", "3.14159", "1,000,000", "٣٤٥", "१२३", "１２３", "²", "½", "Ⅻ", "2024-05-01"]
EMOJI = ["🦙", "😀", "👍🏽", "👨‍👩‍👧", "🏳️‍🌈", "❤️", "✅", "🚀", "🇩🇪", "\u2063"]
SPACES = [" ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n ", "\u00a0", "\u3000", "\u2009", "\v", "\f", "    "]
CODE = ["def f(x):\n    return x**2", "if (a && b) { c++; }", "x = [1, 2, 3]", "<div class=\"a\">", "SELECT * FROM t;",
        "it's", "I'LL", "we're", "they've", "'s", "don't", "#include <stdio.h>", "a->b", "::", "...", "!!!", "$$",
        "C:\\path\\to", "https://example.com/?q=1&r=2", "\\n", "`code`", "~~~", "@user", "50%"]
RARE = ["\u0378", "\U0001F9FF", "\U000E0041", "\u200b", "\ufeff", "\U00010000", "\u05d0\u05b8", "ﷺ", "𝔘𝔫𝔦", "\x01"]


def random_strings(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    pools = (SCRIPTS, DIGITS, EMOJI, SPACES, CODE, RARE)
    out = []
    for _ in range(n):
        parts = [rng.choice(rng.choice(pools)) for _ in range(rng.randint(1, 12))]
        if rng.random() < 0.3:
            parts.append("".join(chr(rng.randint(0x20, 0x2FFF)) for _ in range(rng.randint(1, 6))))
        s = "".join(p + (rng.choice(SPACES) if rng.random() < 0.4 else "") for p in parts)
        out.append("".join(c for c in s if not 0xD800 <= ord(c) <= 0xDFFF))
    return out


def _special_texts(tok, seed: int) -> list[str]:
    """Strings with the vocabulary's control and user-defined token texts inside, for parse_special."""
    rng = random.Random(seed)
    vocab = tok.tok
    specials = [vocab.tokens[i] for i in vocab.special_cache][:40] or ["<s>"]
    return ["".join(rng.choice([rng.choice(specials), rng.choice(SCRIPTS), rng.choice(SPACES), rng.choice(CODE)])
                    for _ in range(rng.randint(1, 8))) for _ in range(30)]


def test_random_strings_match_llama_cpp(vocab_root, vocabs):
    requests, ours = [], []
    for k, name in enumerate(GENERATIVE):
        tok, path = vocabs[name], str(vocab_root / f"ggml-vocab-{name}.gguf")
        plain, special = random_strings(1000 + k, N_RANDOM), _special_texts(tok, 2000 + k)
        requests += [{"gguf": path, "texts": plain, "add_special": False, "parse_special": False},
                     {"gguf": path, "texts": special, "add_special": True, "parse_special": True}]
        ours += [[tok.tok.encode(t) for t in plain],
                 [tok.tok.encode(t, add_special=True, parse_special=True) for t in special]]
        missing = _bytes_without_token(tok.tok)
        kept = [t for t in plain if not missing & set(t.encode())]
        assert len(kept) >= N_RANDOM // 2, name
        for t in kept:                       # text the vocabulary can spell decodes back to itself
            assert tok.decode(tok.encode(t, add_special=False, parse_special=False)) == t, (name, t)
    theirs = llama_tokenize_many(requests)
    for req, mine, ref in zip(requests, ours, theirs):
        bad = [t for t, a, b in zip(req["texts"], mine, ref) if a != b]
        assert not bad, f"{req['gguf']}: {len(bad)} of {len(mine)} differ from llama.cpp, e.g. {bad[0]!r}"


def _behaviour(pre: str) -> tuple:
    kind, flags = PRE_NAMES[pre]
    return REGEXES[kind][0], flags.get("ignore_merges", False)


def test_every_other_byte_level_pre_tokenizer_matches_llama_cpp(vocab_root, metas, tmp_path):
    """GPT-2's vocabulary relabelled with one `tokenizer.ggml.pre` name for each byte-level
    pre-tokenizer behaviour (regex list, ignore_merges) that no vocab file above exercises: the
    regex lists, the hand-written splitters and the collapsed-regex path all meet llama.cpp."""
    covered = {_behaviour(m.get("tokenizer.ggml.pre") or "default") for m in metas.values()
               if m["tokenizer.ggml.model"] == "gpt2"}
    names: dict[tuple, str] = {}
    for pre, (kind, _) in PRE_NAMES.items():
        if REGEXES[kind][1] and _behaviour(pre) not in covered:
            names.setdefault(_behaviour(pre), pre)
    assert len(covered) == 9 and len(names) == 21          # 30 behaviours in llama.cpp 0.3.36
    texts = random_strings(7, 40)
    requests, ours = [], []
    for pre in names.values():
        path = with_pre(vocab_root / "ggml-vocab-gpt-2.gguf", pre, tmp_path / f"{pre}.gguf")
        vocab = GgufVocab(read_header(path)[0])
        requests.append({"gguf": str(path), "texts": texts, "add_special": False, "parse_special": False})
        ours.append([vocab.encode(t) for t in texts])
    theirs = llama_tokenize_many(requests)
    for pre, mine, ref in zip(names.values(), ours, theirs):
        bad = [t for t, a, b in zip(texts, mine, ref) if a != b]
        assert not bad, f"pre {pre!r}: {len(bad)} of {len(texts)} differ from llama.cpp, e.g. {bad[0]!r}"


def _bytes_without_token(vocab: GgufVocab) -> set[int]:
    """Bytes no token spells (Falcon, MPT, StarCoder lack some); llama.cpp drops them when encoding."""
    if vocab.algo == "bpe" and vocab.byte_encode:
        return {b for b in range(256) if pretok.BYTE_TO_UNICODE[b] not in vocab.token_to_id_map}
    return {b for b in range(256) if f"<0x{b:02X}>" not in vocab.token_to_id_map}


# ---------------------------------------------------------------------------- streaming
@pytest.mark.parametrize("name", ["llama-spm", "gemma-4", "qwen35", "llama-bpe"])
def test_streamed_tokens_never_split_a_character(name, vocabs):
    tok = vocabs[name]
    text = "Ünïcödé 🦙🏳️‍🌈 ꙮ𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ᐊᐃᓐᓇᐅ 鿐 end"
    ids = tok.encode(text, add_special=False)
    pieces = [tok.tok.piece(i) for i in ids]
    split = [p for p in pieces if p and _incomplete(p)]
    assert split, f"{name}: expected byte tokens splitting multi-byte characters"
    det = Detokenizer(tok)
    deltas = [det.push(i) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas                                   # a partial character was held back
    assert "".join(deltas) + det.flush() == tok.decode(ids) == text


def _incomplete(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


def test_stream_flush_reports_a_dangling_partial_character(vocabs):
    tok = vocabs["llama-spm"]
    ids = tok.encode("🦙", add_special=False)
    det = Detokenizer(tok)
    assert [det.push(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert det.flush() == "\ufffd"


# ---------------------------------------------------------------------------- BOS and bad metadata
def test_bos_follows_the_vocabulary_and_is_never_doubled(vocabs):
    spm, gemma, qwen = vocabs["llama-spm"], vocabs["gemma-4"], vocabs["qwen35"]
    assert spm.encode("Hi")[0] == spm.bos_id and spm.encode("Hi", add_special=False)[0] != spm.bos_id
    assert spm.encode("<s>Hi") == spm.encode("Hi")                     # a rendered template's BOS is kept once
    assert gemma.encode("Hi")[0] == gemma.bos_id                        # llama.cpp forces add_bos for Gemma 4
    assert qwen.encode("Hi") == qwen.encode("Hi", add_special=False)    # Qwen adds no BOS
    im_start = qwen.token_id("<|im_start|>")
    assert qwen.encode("<|im_start|>user")[0] == im_start
    assert im_start not in qwen.encode("<|im_start|>user", parse_special=False)


def test_eog_set_and_template_tokens_follow_llama_cpp(vocabs):
    qwen, llama3 = vocabs["qwen35"], vocabs["llama-bpe"]
    assert {qwen.token_id("<|im_end|>"), qwen.token_id("<|endoftext|>")} <= qwen.eos_ids
    assert qwen.token_id("<|im_start|>") not in qwen.eos_ids
    assert llama3.token_id("<|eot_id|>") in llama3.eos_ids and llama3.token_id("<|end_of_text|>") in llama3.eos_ids
    assert qwen.chat.eos == "<|endoftext|>" and llama3.chat.bos == "<|begin_of_text|>"   # tokenizer.ggml.eos/bos


def test_malformed_metadata_is_a_one_line_error(metas):
    meta = dict(metas["llama-spm"])
    meta["tokenizer.ggml.scores"] = meta["tokenizer.ggml.scores"][:10]
    with pytest.raises(MawError) as e:
        GgufVocab(meta)
    assert "\n" not in str(e.value)
    bpe = {k: v for k, v in metas["qwen2"].items() if k != "tokenizer.ggml.merges"}
    with pytest.raises(MawError, match="merges"):
        GgufVocab(bpe)
