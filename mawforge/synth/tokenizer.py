"""The synthetic files' tokenizer: a Qwen-like byte-level BPE with real merges, fillers and Qwen's
special tokens, and a ChatML chat template, as llama.cpp reads them from GGUF metadata."""
from __future__ import annotations

from gguf import GGUFWriter

CHATML = ("{% for message in messages %}"
          "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
            "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
            "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
            "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>",
            "</tool_response>", "<think>", "</think>"]


def byte_tokens() -> list[str]:
    """GPT-2 byte-level alphabet in byte order; llama.cpp looks every byte up by this text."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def tokenizer(vocab: int) -> tuple[list[str], list[int], list[str], int, int]:
    """Qwen-like layout: byte tokens, merged letter pairs (a real BPE), fillers, and the
    Qwen special tokens 293 from the end, where Qwen3 has them at vocab 151936."""
    first_special = vocab - 293
    letters = "abcdefghijklmnopqrstuvwxyz"
    pairs = [("Ġ", c) for c in letters] + [(a, c) for a in letters for c in letters]
    pairs = pairs[: first_special - 256]
    tokens = byte_tokens() + [a + c for a, c in pairs]
    tokens += [f"[PAD{i}]" for i in range(len(tokens), first_special)]
    tokens += SPECIALS + [f"[PAD{i}]" for i in range(first_special + len(SPECIALS), vocab)]
    types = [1] * vocab
    types[first_special:first_special + len(SPECIALS)] = [3] * len(SPECIALS)  # CONTROL
    return tokens, types, [f"{a} {c}" for a, c in pairs], first_special, first_special + 2


def add_tokenizer(w: GGUFWriter, vocab: int) -> None:
    """The synthetic byte-level BPE (tokenizer()) and ChatML template, as llama.cpp reads them."""
    tokens, types, merges, bos, eos = tokenizer(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    for key, tid in (("bos", bos), ("eos", eos), ("padding", bos)):
        w.add_uint32(f"tokenizer.ggml.{key}_token_id", tid)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
