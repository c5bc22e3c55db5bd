"""What the structured-output mask costs per token, beside a decode step of the same run.

1. On a pack (default: the shipped demo model): one greedy request plain and one under a JSON
   schema; the constraint's time (llguidance's mask + applying it to the logits) per token
   against the plain run's decode time per token.
2. On real-size vocabularies (llama.cpp's qwen35 and gemma-4 test vocabularies, 152k and 262k
   ids; no model): the same schema walked token by token over a valid document, the mask
   computed and applied to random logits at every position. The mask's cost grows with V, the
   decode step's with the model; both are printed so the full-size ratio can be estimated.

    python benchmarks/structured_mask.py [--pack PACK] [--tokens 64] [--vocabs qwen35 gemma-4]
Wall-clock on a busy machine: read the ratios and medians (a busy machine inflates the means).
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "name", "n", "tags", "note"],
          "properties": {"city": {"enum": ["Zürich", "東京", "Paris"]}, "name": {"type": "string", "maxLength": 24},
                         "n": {"type": "integer", "minimum": 0, "maximum": 999},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
                         "note": {"type": "string"}}}
DOC = {"city": "東京", "name": "A dictionary maps keys", "n": 12, "tags": ["the", "LORD", "ü"],
       "note": "To every thing there is a season, and a time to every purpose under the heaven: naïve café."}


def timed(constraint):
    """Wrap a Constraint's __call__ (mask + apply) with a per-call clock."""
    from mawforge.engine.constraint import Constraint

    class Timed(Constraint):
        def __call__(self, logits):
            t = time.perf_counter()
            out = super().__call__(logits)
            self.seconds.append(time.perf_counter() - t)
            return out
    c = Timed(constraint.vocab, constraint.m)
    c.seconds = []
    return c


def on_pack(pack: Path, n: int) -> dict:
    from mawforge.engine import constraint as C
    from mawforge.engine.generate import generate
    from mawforge.engine.runtime import Runtime, RuntimeOptions
    from mawforge.engine.sampling import SamplingParams
    rt = Runtime(pack, RuntimeOptions(context=2048))
    try:
        ids = rt.tokenizer.encode("<|im_start|>user\nDescribe a city as JSON.<|im_end|>\n<|im_start|>assistant\n")
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        plain = [e for e in generate(rt, ids, params)][-1].telemetry
        v = C.token_vocab(rt.tokenizer, rt.cfg.vocab)
        c = timed(C.Constraint(v, C.compile_grammar(v, C.json_schema_grammar(SCHEMA))))
        evs = list(generate(rt, ids, SamplingParams(max_tokens=n, temperature=0.0), processors=[c]))
        step_ms = 1000 * plain.decode_s / max(1, plain.completion_tokens - 1)
        mask_ms = 1000 * sum(c.seconds) / len(c.seconds)
        return {"pack": str(pack), "vocab": rt.cfg.vocab, "decode_ms_per_token": step_ms,
                "mask_ms_per_token": mask_ms, "mask_ms_median": 1000 * statistics.median(c.seconds),
                "mask_over_decode": mask_ms / step_ms,
                "constrained_tokens": len(evs), "finish": evs[-1].finish_reason}
    finally:
        rt.close()


def on_vocab(name: str) -> dict:
    from mawforge.engine import constraint as C
    from mawforge.text.tokenizer import from_gguf_metadata
    from mawforge.fixtures.llama_vocabs import vocab_dir
    from mawforge.formats.gguf import read_header
    tok = from_gguf_metadata(read_header(vocab_dir() / f"ggml-vocab-{name}.gguf")[0])
    t = time.perf_counter()
    v = C.token_vocab(tok, tok.vocab_size)
    build_s = time.perf_counter() - t
    t = time.perf_counter()
    c = timed(C.Constraint(v, C.compile_grammar(v, C.json_schema_grammar(SCHEMA))))
    compile_s = time.perf_counter() - t
    ids = v.tokenize(json.dumps(DOC, ensure_ascii=False).encode())
    logits = torch.randn(v.n)
    for i in ids:
        c(logits)
        c.accept(i)
    assert c.done, "the document does not walk the schema"
    return {"vocab": name, "V": v.n, "table_and_tokenizer_s": build_s, "compile_s": compile_s, "tokens": len(ids),
            "mask_ms_per_token": 1000 * sum(c.seconds) / len(c.seconds),
            "mask_ms_median": 1000 * statistics.median(c.seconds),
            "mask_ms_max": 1000 * max(c.seconds)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pack", default=None, help="a pack (default: the demo model, packed into a temp dir)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--vocabs", nargs="*", default=["qwen35", "gemma-4"])
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.pack is None:
        from mawforge.demo import demo_gguf
        from mawforge.pack.packer import pack
        tmp = Path(tempfile.mkdtemp()) / "demo"
        pack(demo_gguf("Q8_0"), tmp, progress=False)
        a.pack = tmp
    print(json.dumps(on_pack(Path(a.pack), a.tokens)))
    for name in a.vocabs:
        print(json.dumps(on_vocab(name)))


if __name__ == "__main__":
    main()
