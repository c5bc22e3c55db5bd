"""Tokenizers from the pack: HF tokenizer.json, or GGUF metadata (gpt2-style byte-level BPE and
llama SentencePiece vocabularies) rebuilt as a `tokenizers` object; chat templates live in engine/chat.py."""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from mawforge.engine.chat import DEFAULT_CHAT_TEMPLATE, ChatTemplate  # noqa: F401  (re-exported: the old home)
from mawforge.errors import FormatError

# llama.cpp pre-tokenizer names -> split regex (from llama-vocab.cpp).
_PRE_REGEX = {
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "llama3": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
_CONTROL, _USER_DEFINED = 3, 4


class TextTokenizer:
    def __init__(self, tok: Tokenizer, bos_id: int | None, eos_ids: set[int], add_bos: bool,
                 chat_template: str | None):
        self.tok, self.bos_id, self.eos_ids, self.add_bos = tok, bos_id, eos_ids, add_bos
        bos = tok.id_to_token(bos_id) if bos_id is not None else ""
        eos = tok.id_to_token(min(eos_ids)) if eos_ids else ""
        self.chat = ChatTemplate(chat_template, bos or "", eos or "")

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        if add_special and self.add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def token_id(self, text: str) -> int | None:
        return self.tok.token_to_id(text)


class Detokenizer:
    """Incremental decoding that never emits half a UTF-8 character."""

    def __init__(self, tok: TextTokenizer):
        self.tok, self.ids, self.emitted = tok, [], ""

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        delta, self.emitted = text[len(self.emitted):], text
        return delta


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
    tok = Tokenizer.from_file(str(path))
    cfg = json.loads((pack / "tokenizer_config.json").read_text()) if (pack / "tokenizer_config.json").exists() else {}
    template = cfg.get("chat_template")
    if (pack / "chat_template.jinja").exists():
        template = (pack / "chat_template.jinja").read_text()

    def tid(key):
        v = cfg.get(key)
        v = v.get("content") if isinstance(v, dict) else v
        return tok.token_to_id(v) if v else None

    eos = {i for i in (tid("eos_token"),) if i is not None}
    gen = pack / "generation_config.json"
    if gen.exists():
        e = json.loads(gen.read_text()).get("eos_token_id")
        eos |= set(e if isinstance(e, list) else [e] if e is not None else [])
    bos = tid("bos_token")
    return TextTokenizer(tok, bos, eos, bool(cfg.get("add_bos_token", False)) and bos is not None, template)


def from_gguf_metadata(meta: dict) -> TextTokenizer:
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise FormatError("GGUF has no tokenizer.ggml.tokens")
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    if kind == "gpt2":
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
        tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, ignore_merges=False))
        regex = _PRE_REGEX.get(meta.get("tokenizer.ggml.pre", ""))
        bl = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=regex is None)
        tok.pre_tokenizer = bl if regex is None else pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(regex), behavior="isolated"), bl])
        tok.decoder = decoders.ByteLevel()
        add_bos_default = False
    elif kind == "llama":
        tok = _spm_tokenizer(tokens, meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens), types)
        add_bos_default = True
    else:
        raise FormatError(f"GGUF tokenizer model {kind!r} is not supported (gpt2, llama)")
    special = [AddedToken(t, special=True, normalized=False)
               for t, ty in zip(tokens, types) if ty in (_CONTROL, _USER_DEFINED)]
    tok.add_special_tokens(special)
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = {meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta}
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)) and bos is not None
    return TextTokenizer(tok, bos, eos, add_bos, meta.get("tokenizer.chat_template"))


def _spm_tokenizer(tokens: list[str], scores: list[float], types: list[int]) -> Tokenizer:
    """SentencePiece BPE as HF's LlamaConverter builds it: merges ranked by the merged piece's score."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for piece, score in sorted(((t, s) for t, s, ty in zip(tokens, scores, types) if ty == 1),
                               key=lambda x: -x[1]):
        for i in range(1, len(piece)):
            a, b = piece[:i], piece[i:]
            if a in vocab and b in vocab:
                merges.append((vocab[piece], vocab[a], vocab[b], a, b))
    merges.sort(key=lambda m: (-scores[m[0]], m[1], m[2]))
    tok = Tokenizer(models.BPE(vocab, [(m[3], m[4]) for m in merges], unk_token=tokens[0] if tokens else None,
                               fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return tok
