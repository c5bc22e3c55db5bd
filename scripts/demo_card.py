"""Render mawforge/demo/MODEL_CARD.md from the measured stats.json, so every figure in the
card comes from `python scripts/train_demo_model.py stats` and none is typed by hand."""
from __future__ import annotations

from pathlib import Path


def _table(header: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + \
           ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]


def write_card(s: dict, out: Path) -> Path:
    c, t, h, k = s["config"], s["train"], s["heldout"], s["cache"]
    corpus = s["corpus"]
    lines = [
        f"# {s['model']}: the demo model",
        "",
        "A small Qwen3-MoE trained on this project's machines so `make demo` prints English and the",
        "tests and `mawforge synth` have a trained model's routing to compare against. It is a toy:",
        "it imitates the style of its corpus, it does not know things.",
        "",
        "## Files",
        "",
        *_table(["file", "bytes", "made by"], [
            [f"`{s['model']}-{f}.gguf`", n, "llama.cpp `llama_model_quantize` from the F32 GGUF"]
            for f, n in s["files"].items()]),
        "",
        "`tokenizer.json`, `tokenizer_config.json`: the same vocabulary for Hugging Face `tokenizers`;",
        "`routing-profile.json`: per-layer routing for `mawforge synth --routing-profile`;",
        "`stats.json`: every figure below, machine-readable.",
        "",
        "## Architecture",
        "",
        f"`qwen3moe` (transformers `Qwen3MoeForCausalLM`): {c['num_hidden_layers']} layers, hidden "
        f"{c['hidden_size']}, {c['num_attention_heads']} query / {c['num_key_value_heads']} KV heads of dim "
        f"{c['head_dim']}, QK RMSNorm, RoPE base {c['rope_theta']:g}, {c['num_experts']} experts of FFN "
        f"{c['moe_intermediate_size']}, top-{c['num_experts_per_tok']} with renormalized weights, every layer "
        f"MoE, untied output head, vocabulary {c['vocab_size']}. {s['params']:,} parameters.",
        "",
        "Tokenizer: byte-level BPE trained on the train split with the `tokenizers` library, Qwen2's",
        "pre-tokenizer regex (`tokenizer.ggml.model = gpt2`, `tokenizer.ggml.pre = qwen2`: llama.cpp",
        "applies the same split; tests/test_demo_model.py checks ids agree), specials `<|endoftext|>`",
        "(BOS/PAD), `<|im_start|>`, `<|im_end|>` (EOS), a ChatML chat template.",
        "",
        "## Corpus",
        "",
        *_table(["source", "license", "Debian origin", "documents", "characters"], [
            [name, v["license"], v["origin"], v["documents"], f"{v['chars']:,}"]
            for name, v in corpus["sources"].items()]),
        "",
        f"Documents (a Bible chapter, a documentation page) are split by a hash of their name: "
        f"{corpus['heldout_documents']} held out (1 in {corpus['heldout_every']}), {corpus['train_documents']} for "
        f"training, plus {corpus['chat_samples']:,} ChatML conversations made from training documents (a docs "
        f"heading asked as a question, its first paragraph as the answer; a verse reference and its verse). "
        f"Train split: {corpus['train_chars']:,} characters, {s['tokens_train_split']:,} tokens. The Debian "
        "Reference (GPL-2+) was left out so the weights carry no copyleft question. "
        "`scripts/demo_corpus.py` installs, extracts and cleans everything.",
        "",
        "## Training",
        "",
        f"torch on CPU, one thread, seed {t['args']['seed']}: AdamW (0.9, 0.95), weight decay 0.1, peak lr "
        f"{t['args']['lr']}, {t['args']['warmup']} warm-up steps then cosine to 10% over {t['args']['steps']} steps, "
        f"batch 16 x 256 tokens, gradient clip 1.0, Switch-style load-balance loss x {t['args']['aux_coef']}. "
        f"**{t['steps']} steps, {t['tokens_seen']:,} tokens seen, {t['wall_minutes']} minutes** on one shared core. "
        f"Training cross-entropy over the last 50 steps: {t['last_ce']}.",
        "",
        f"**Held-out perplexity: {h['perplexity']}** over {h['tokens']:,} tokens (float32 weights, non-overlapping "
        "256-token windows of the held-out documents).",
        "",
        "## Samples (greedy, float32 weights, 48 tokens at most)",
        "",
        *[f"- `{x['prompt']!r}` → `{x['greedy']!r}`" for x in s["samples"]],
        "",
        "What `make demo` prints (MawForge runtime, Q4_K_M pack, chat template, greedy, expert cache at",
        "25% of routed expert bytes):",
        "",
        *[f"- `{x['question']!r}` → `{x['answer']!r}`" for x in s["runtime_chat"]],
        "",
        "## Routing (held-out text, teacher-forced)",
        "",
        "Popularity: the share of routed slots each expert takes, most popular first. Overlap: mean",
        "|S_t ∩ S_t-1| / k with the previous token's experts; independent: what tokens routed",
        "independently with the same popularity would overlap.",
        "",
        *_table(["layer", "entropy (1 = uniform)", "top-2 share", "overlap", "independent", "popularity (shares)"], [
            [r["layer"], r["entropy"], r["top2_share"], r["overlap"], r["overlap_if_independent"],
             " ".join(f"{x:.3f}" for x in r["popularity"])] for r in s["routing"]]),
        "",
        f"Expert cache, replayed with `mawforge.trace.replay` over {k['tokens']:,} held-out tokens as decode "
        f"steps, with the Q4_K_M pack's block sizes, at {k['budget']} of routed expert bytes: **LRU hit rate "
        f"{k['lru']:.3f}** in text order against **{k['lru_shuffled_mean']:.3f}** with the same tokens in shuffled "
        f"order (popularity kept, locality removed; mean of {len(k['lru_shuffled'])} shuffles); Belady "
        f"{k['belady']:.3f}.",
        "",
        "## Remake",
        "",
        "```",
        "python scripts/train_demo_model.py all        # corpus, tokenizer, train, export, stats (this card)",
        "```",
        "The shipped run is one lineage of checkpoints with three schedules, because load from other",
        "work on the shared two-core machine left its one thread 15-50% of a core: steps 0-250 ran under",
        "a 1500-step cosine, 250-350 under 1150, 350-700 under the final 700 (`stats.json` train.args",
        "holds the last run's arguments). `all` with the defaults gives a different, longer run.",
    ]
    out.write_text("\n".join(lines) + "\n")
    return out
