"""Tokenizers from the pack: HF tokenizer.json through `tokenizers`, or GGUF metadata through
llama_vocab.GgufVocab (llama.cpp's own algorithm, exact on its test vectors); chat templates live in
text/chat.py."""
from __future__ import annotations

import codecs
import functools
import json
from pathlib import Path

from tokenizers import Tokenizer

from mawforge.text.chat import DEFAULT_CHAT_TEMPLATE, ChatTemplate  # noqa: F401  (re-exported: the old home)
from mawforge.text.llama_vocab import GgufVocab
from mawforge.text.pretok import UNICODE_TO_BYTE
from mawforge.errors import FormatError


class HfVocab:
    """A tokenizer.json through `tokenizers`, behind the interface GgufVocab offers."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok

    def encode(self, text: str, add_special: bool = False, parse_special: bool = True) -> list[int]:
        if self.tok.encode_special_tokens == parse_special:
            self.tok.encode_special_tokens = not parse_special
        return self.tok.encode(text, add_special_tokens=add_special).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def id_to_token(self, i: int) -> str | None:
        return self.tok.id_to_token(i)

    def token_to_id(self, text: str) -> int | None:
        return self.tok.token_to_id(text)

    def get_vocab(self, with_added_tokens: bool = True) -> dict[str, int]:
        return self.tok.get_vocab(with_added_tokens=with_added_tokens)

    def piece(self, tid: int) -> bytes:
        """One token's bytes: byte-level BPE maps its characters back to bytes, a byte-fallback
        token <0xHH> is that byte, a SentencePiece piece has its U+2581 as spaces; an added token
        is its text."""
        text = self.tok.id_to_token(tid) or ""
        if self.tok.id_to_token(tid) in self.added:
            return text.encode()
        if type(self.tok.decoder).__name__ == "ByteLevel" and all(c in UNICODE_TO_BYTE for c in text):
            return bytes(UNICODE_TO_BYTE[c] for c in text)
        if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
            try:
                return bytes([int(text[3:5], 16)])
            except ValueError:
                pass
        return text.replace("\u2581", " ").encode()

    @functools.cached_property
    def added(self) -> set[str]:
        return {t.content for t in self.tok.get_added_tokens_decoder().values()}

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        return self.tok.get_vocab_size(with_added_tokens=with_added_tokens)


class TextTokenizer:
    """The engine's tokenizer: a vocabulary (GgufVocab or HfVocab), its BOS/EOS policy and chat template.
    `eos_ids` is every id that ends generation (llama.cpp's EOG set for GGUF, eos_token plus
    generation_config's eos_token_id list for HF)."""

    def __init__(self, tok: GgufVocab | HfVocab, bos_id: int | None, eos_ids: set[int], add_bos: bool,
                 chat_template: str | None, eos_id: int | None = None):
        self.tok, self.bos_id, self.eos_ids, self.add_bos = tok, bos_id, eos_ids, add_bos
        bos = tok.id_to_token(bos_id) if bos_id is not None else ""
        # the template's eos_token is the vocabulary's EOS, not any id that ends generation
        eos_id = eos_id if eos_id is not None else min(eos_ids) if eos_ids else None
        eos = tok.id_to_token(eos_id) if eos_id is not None else ""
        self.chat = ChatTemplate(chat_template, bos or "", eos or "")
        # does the vocabulary itself put BOS first (llama.cpp's add_bos, a tokenizer.json post-processor)?
        self.auto_bos = bos_id is not None and tok.encode("", add_special=True, parse_special=False)[:1] == [bos_id]

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self.tok.get_vocab(with_added_tokens=True)

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """add_special: BOS/EOS as the vocabulary asks (llama.cpp's add_bos/add_eos, or tokenizer.json's
        post-processor and add_bos_token), one BOS only when the text already starts with it, as
        rendered chat templates do; parse_special: special-token text becomes its id."""
        ids = self.tok.encode(text, add_special=add_special, parse_special=parse_special)
        if add_special and self.bos_id is not None:
            if self.auto_bos:
                if len(ids) >= 2 and ids[1] == self.bos_id:       # the text began with BOS
                    ids = ids[1:]
            elif self.add_bos and ids[:1] != [self.bos_id]:       # add_bos_token, no post-processor
                ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)

    def token_bytes(self, tid: int) -> bytes:
        """The bytes one token stands for (a multi-byte character may be split over tokens)."""
        return self.tok.piece(tid)

    def token_id(self, text: str) -> int | None:
        return self.tok.token_to_id(text)


class Detokenizer:
    """Incremental decoding that never emits half a UTF-8 character. GGUF vocabularies give each
    token's bytes, fed through an incremental UTF-8 decoder; for tokenizer.json the text of a
    short window of tokens is decoded and only what follows the window's already-emitted prefix is
    returned, held back while it ends in an incomplete character (U+FFFD)."""

    def __init__(self, tok: TextTokenizer):
        self.tok, self.ids = tok, []
        self.prefix = self.read = 0
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.vocab = tok.tok if isinstance(tok.tok, GgufVocab) else None

    def push(self, token: int) -> str:
        self.ids.append(token)
        if self.vocab is not None:
            piece = self.vocab.piece(token)
            if len(self.ids) == 1 and self.vocab.add_space_prefix and piece.startswith(b" "):
                piece = piece[1:]
            return self.utf8.decode(piece)
        seen = self.tok.decode(self.ids[self.prefix:self.read])
        text = self.tok.decode(self.ids[self.prefix:])
        if len(text) <= len(seen) or text.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(seen):]

    def flush(self) -> str:
        """What is held back at the end of a stream (an incomplete character becomes U+FFFD)."""
        if self.vocab is not None:
            return self.utf8.decode(b"", final=True)
        return self.tok.decode(self.ids[self.prefix:])[len(self.tok.decode(self.ids[self.prefix:self.read])):]


def load_tokenizer(pack: Path, info: dict) -> TextTokenizer:
    if info.get("kind") == "hf":
        return _from_hf(pack)
    if info.get("kind") == "gguf":
        meta = json.loads((pack / "tokenizer.gguf.json").read_text())
        return from_gguf_metadata(meta)
    raise FormatError(f"{pack}: pack has no tokenizer")


def _from_hf(pack: Path) -> TextTokenizer:
    path = pack / "tokenizer.json"
    if not path.exists():
        raise FormatError(f"{pack}: no tokenizer.json in the pack")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:               # the tokenizers library's own parse errors
        why = (str(e).splitlines() or [type(e).__name__])[0]
        raise FormatError(f"{path.name} in the pack does not load: {why}") from None
    cfg = _json(pack / "tokenizer_config.json")
    template = cfg.get("chat_template")
    if isinstance(template, list):       # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    if (pack / "chat_template.json").exists():
        template = _json(pack / "chat_template.json").get("chat_template", template)
    if (pack / "chat_template.jinja").exists():
        template = (pack / "chat_template.jinja").read_text()

    def tid(key):
        v = cfg.get(key)
        v = v.get("content") if isinstance(v, dict) else v
        return tok.token_to_id(v) if v else None

    eos_id = tid("eos_token")
    eos = {i for i in (eos_id,) if i is not None}
    e = _json(pack / "generation_config.json").get("eos_token_id")
    eos |= set(e if isinstance(e, list) else [e] if e is not None else [])
    bos = tid("bos_token")
    return TextTokenizer(HfVocab(tok), bos, eos, bool(cfg.get("add_bos_token", False)) and bos is not None, template,
                         eos_id)


def _json(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        d = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise FormatError(f"{path.name} in the pack is not valid JSON") from None
    return d if isinstance(d, dict) else {}


def from_gguf_metadata(meta: dict) -> TextTokenizer:
    vocab = GgufVocab(meta)
    return TextTokenizer(vocab, vocab.bos, set(vocab.eog), vocab.add_bos and vocab.bos is not None,
                         meta.get("tokenizer.chat_template"), vocab.eos)
