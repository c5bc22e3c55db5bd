"""Count how many of llama.cpp's tokenizer vectors (ggml-vocab-*.gguf.inp/.out in the pinned sdist)
MawForge's GGUF tokenizer reproduces exactly, per vocabulary file; every vector line is counted,
repeated inputs included, and a file that does not load counts all its lines as misses.

    python scripts/vocab_vectors.py
"""
from __future__ import annotations

from pathlib import Path

from mawforge.text.tokenizer import from_gguf_metadata
from mawforge.fixtures.llama_vocabs import SEPARATOR, vocab_dir, vocab_files
from mawforge.formats.gguf import read_header


def main() -> None:
    total = exact = files = 0
    for path in vocab_files(vocab_dir(), generative=False):
        inp = Path(str(path) + ".inp")
        if not inp.exists():
            continue
        texts = inp.read_text().split(SEPARATOR)
        outs = [[int(x) for x in line.split()] for line in Path(str(path) + ".out").read_text().split("\n")]
        files, total = files + 1, total + len(texts)
        try:
            tok = from_gguf_metadata(read_header(path)[0])
        except Exception as e:           # noqa: BLE001 - a refused vocabulary is a result here
            print(f"{path.name}: does not load ({e})")
            continue
        try:
            good = sum(tok.encode(t, add_special=False, parse_special=False) == o for t, o in zip(texts, outs))
        except TypeError:                # before parse_special existed
            good = sum(tok.encode(t, add_special=False) == o for t, o in zip(texts, outs))
        exact += good
        print(f"{path.name}: {good}/{len(texts)}")
    print(f"{exact} of {total} vectors exact over {files} vocab files")


if __name__ == "__main__":
    main()
