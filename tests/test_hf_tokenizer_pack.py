"""HF packs keep the tokenizer as transformers reads it: for a tokenizer directory shaped like each
family's release (added tokens special and not, BOS policy, chat template in tokenizer_config.json,
chat_template.jinja or chat_template.json, generation_config EOS list), `mawforge pack` of a tiny
model with those files, then the pack's tokenizer, give the ids, vocabulary, decoded text, chat
template and EOS set that `transformers.AutoTokenizer` gives from the source directory."""
from __future__ import annotations

import random
import shutil

import pytest
import transformers

from mawforge.text.tokenizer import Detokenizer, load_tokenizer
from mawforge.fixtures.hf_tokenizers import FAMILIES, build_family
from mawforge.pack.manifest import read_manifest
from mawforge.pack.packer import pack


TEXTS = ["Hello world", " leading space", "The cache keeps 42 experts; 3.14159!", "naïve café 🦙 日本語",
         "def f(x):\n    return x  # code\n\n", "  two  spaces\tand tab", "", "it's WE'RE they've"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from mawforge.fixtures.tiny import build_hf
    return build_hf("qwen3_moe", tmp_path_factory.mktemp("tiny") / "hf")


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, model_dir, tmp_path_factory):
    name = request.param
    src = tmp_path_factory.mktemp(name) / "src"
    src.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copyfile(model_dir / f, src / f)
    build_family(name, src)
    out = src.parent / "pack"
    pack(src, out, progress=False)
    return name, src, load_tokenizer(out, read_manifest(out).tokenizer), \
        transformers.AutoTokenizer.from_pretrained(str(src))


def _texts(name: str) -> list[str]:
    fam, rng = FAMILIES[name], random.Random(name)
    words = TEXTS + fam.specials + fam.plain_added
    mixed = ["".join(rng.choice(words) + rng.choice(["", " ", "\n"]) for _ in range(rng.randint(1, 8)))
             for _ in range(40)]
    return TEXTS + mixed + [(fam.bos or "") + "Hi"]


def test_ids_match_transformers(family):
    name, _, ours, ref = family
    for text in _texts(name):
        assert ours.encode(text, add_special=False) == ref(text, add_special_tokens=False)["input_ids"], text
        if not (ref.bos_token and text.startswith(ref.bos_token)):   # ours keeps one BOS there
            assert ours.encode(text) == ref(text)["input_ids"], text


def test_vocab_specials_template_and_eos_survive_the_pack(family):
    name, src, ours, ref = family
    fam = FAMILIES[name]
    assert ours.get_vocab() == ref.get_vocab()
    for t in fam.specials + fam.plain_added:
        assert ours.token_id(t) == ref.convert_tokens_to_ids(t)
    assert ours.chat.source == fam.template
    if fam.template_file != "json":     # transformers reads chat_template.json only for processors
        assert ref.chat_template == fam.template
    gen = transformers.GenerationConfig.from_pretrained(str(src))
    assert ours.eos_ids == {ref.eos_token_id, *gen.eos_token_id}
    assert ours.bos_id == ref.bos_token_id
    assert ours.chat.eos == ref.eos_token and ours.chat.bos == (ref.bos_token or "")


def test_decoding_and_streaming_match_transformers(family):
    name, _, ours, ref = family
    for text in _texts(name):
        ids = ref(text, add_special_tokens=False)["input_ids"]
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=False), text
        det = Detokenizer(ours)
        streamed = "".join(det.push(i) for i in ids) + det.flush()
        assert streamed == ours.decode(ids), text


def test_token_bytes_spell_what_transformers_decodes(family):
    """Each token's bytes (logprobs' `bytes`), joined, are the text transformers decodes (a
    SentencePiece vocabulary's first piece keeps the space its decoder strips)."""
    name, _, ours, ref = family
    for text in _texts(name):
        ids = ref(text, add_special_tokens=False)["input_ids"]
        joined = b"".join(ours.token_bytes(i) for i in ids)
        want = ref.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False).encode()
        assert joined in (want, b" " + want), (text, joined, want)


def test_text_that_starts_with_bos_keeps_one(family):
    name, _, ours, ref = family
    if ref.bos_token:
        text = ref.bos_token + "Hi there"
        assert ours.encode(text) == ref(text, add_special_tokens=False)["input_ids"]


def test_a_broken_tokenizer_json_is_a_one_line_error(tmp_path):
    from mawforge.errors import FormatError
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(FormatError) as e:
        load_tokenizer(tmp_path, {"kind": "hf"})
    assert "tokenizer.json" in str(e.value) and "\n" not in str(e.value)


def test_streaming_holds_back_partial_characters(family):
    """🦙 is four byte tokens in both tiny vocabularies (<0xXX> fallback, or byte-level BPE pieces)."""
    name, _, ours, _ = family
    ids = ours.encode("ok 🦙 ok", add_special=False)
    det = Detokenizer(ours)
    deltas = [det.push(i) for i in ids]
    assert "" in deltas and all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + det.flush() == ours.decode(ids) == "ok 🦙 ok"
