"""The demo model card's figures: held-out perplexity, samples, routing statistics, cache
replay against a shuffled-order baseline, and the routing profile `mawforge synth` reads.

Everything is measured on the held-out documents (never trained on), teacher-forced, with
the float32 torch model from the final checkpoint. The cache figures replay a route trace
through the project's own replay code (mawforge.trace.replay), with the per-layer expert
block sizes of the shipped Q4_K_M file.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict

import numpy as np
import torch

from demo_export import NAME, load_model
from mawforge.synth.routing_profile import measure
from mawforge.trace.record import TraceRecorder
from mawforge.trace.replay import replay

SEQ, BATCH = 256, 16
TRACE_SEQS = 8                  # held-out windows in the route trace (8 x 256 decode steps)
SHUFFLE_SEEDS = (0, 1, 2, 3, 4)
PROMPTS = ("In the beginning", "And the LORD said unto Moses,",
           "The for statement in Python", "A list is",
           "<|im_start|>user\nTell me about the for statement.<|im_end|>\n<|im_start|>assistant\n",
           "<|im_start|>user\nWhat does Genesis 1:3 say?<|im_end|>\n<|im_start|>assistant\n")

DEMO_QUESTIONS = ("What does Genesis 1:3 say?", "Tell me about the for statement.")   # the Makefile's


@torch.no_grad()
def heldout_pass(model, ids: np.ndarray) -> tuple[float, int, list[np.ndarray]]:
    """(perplexity, tokens scored, per-window routes [T, L, K]) over non-overlapping windows."""
    n = (len(ids) - 1) // SEQ
    nll, count, routes = 0.0, 0, []
    for b in range(0, n, BATCH):
        rows = range(b, min(n, b + BATCH))
        x = torch.from_numpy(np.stack([ids[r * SEQ:(r + 1) * SEQ + 1] for r in rows]).astype(np.int64))
        logits, _, idx = model(x[:, :-1])
        nll += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                                 reduction="sum").item()
        count += x[:, 1:].numel()
        per_layer = torch.stack(idx, 1).view(len(rows), SEQ, len(idx), -1)  # [B, T, L, K]
        routes += [np.sort(r.numpy(), -1) for r in per_layer]
    return math.exp(nll / count), count, routes


@torch.no_grad()
def greedy(model, tok, prompt: str, n: int = 48) -> str:
    ids = tok.encode(prompt)
    eos = tok.id_of("<|im_end|>"), tok.id_of("<|endoftext|>")
    out = []
    for _ in range(n):
        nxt = int(model(torch.tensor([ids + out]))[0][0, -1].argmax())
        if nxt in eos:
            break
        out.append(nxt)
    return tok.tokenizer.decode(out)


def runtime_chat(pack, question: str, n: int = 48) -> str:
    """What `make demo` prints: MawForge's runtime on the Q4_K_M pack, chat template, greedy,
    an expert cache of 25% of the routed expert bytes."""
    from mawforge.engine.generate import generate
    from mawforge.engine.runtime import Runtime, RuntimeOptions
    from mawforge.engine.sampling import SamplingParams
    rt = Runtime(pack, RuntimeOptions(context=512, expert_cache_percent=25))
    try:
        ids = rt.tokenizer.encode(rt.tokenizer.chat.render([{"role": "user", "content": question}]))
        return "".join(e.text for e in generate(rt, ids, SamplingParams(max_tokens=n)))
    finally:
        rt.close()


def block_bytes(gguf_path, work) -> list[int]:
    """Per layer, the expert block bytes the live runtime's trace recorder uses (page-rounded
    pack blocks of the shipped file), so these figures match `mawforge replay` on live traces."""
    from mawforge.cache.store import round_page
    from mawforge.pack.manifest import read_index
    from mawforge.pack.packer import pack
    pack(gguf_path, work / "pack-Q4_K_M", force=True, progress=False)
    return [round_page(lb.block_nbytes) for lb in read_index(work / "pack-Q4_K_M").layers]


def trace_of(routes: list[np.ndarray], n_experts: int, sizes: list[int]):
    """A decode-step trace (one token per step) of the windows, in order."""
    rec = TraceRecorder(n_layers=len(sizes), n_experts=n_experts, top_k=routes[0].shape[2],
                        block_bytes=sizes, model=NAME)
    for seq in routes:
        for tok in seq:                                        # [L, K]
            rec.begin_step("decode", 1)
            for layer, experts in enumerate(tok):
                rec.record(layer, experts[None], np.full((1, len(experts)), 1.0 / len(experts)))
    return rec.to_trace()


def cache_figures(routes, n_experts, sizes) -> dict:
    """LRU and Belady hit rates at 50% of routed expert bytes: text order, and the same
    tokens in shuffled order (locality removed, popularity kept)."""
    seqs = routes[:TRACE_SEQS]
    rate = lambda tr, pol: next(r for r in replay(tr, ["50%"], [pol]) if r["policy"] == pol)["hit_rate"]  # noqa: E731
    text = trace_of(seqs, n_experts, sizes)
    flat = np.concatenate(seqs)
    shuffled = [rate(trace_of([flat[np.random.default_rng(s).permutation(len(flat))]], n_experts, sizes), "lru")
                for s in SHUFFLE_SEEDS]
    return {"tokens": len(flat), "budget": "50%", "lru": rate(text, "lru"), "belady": rate(text, "belady"),
            "lru_shuffled_mean": float(np.mean(shuffled)), "lru_shuffled": shuffled}


def _last_ce(log, step: int) -> float:
    """Mean training cross-entropy over the last 50 steps (the log's last lines up to `step`)."""
    rows = [json.loads(x) for x in log.read_text().splitlines()]
    ce = {r["step"]: r["ce"] for r in rows if r["step"] <= step}          # a resumed run rewrites its steps
    return round(float(np.mean([ce[s] for s in sorted(ce)[-5:]])), 3)


def step_stats(a) -> None:
    torch.set_num_threads(a.threads)
    from mawforge.fixtures.tokenizer import ByteBpeTokenizer
    tok = ByteBpeTokenizer.load_hf(a.work / "tokenizer")
    model = load_model(a.work)
    state = torch.load(a.work / "ckpt.pt", weights_only=False)
    ppl, scored, routes = heldout_pass(model, np.load(a.work / "heldout.npy").astype(np.int64))
    profile = measure(routes, model.c.num_experts, source=f"{NAME}, {scored} held-out tokens, teacher-forced")
    profile.save(a.out / "routing-profile.json")
    sizes = block_bytes(a.out / f"{NAME}-Q4_K_M.gguf", a.work)
    stats = {
        "model": NAME, "config": asdict(model.c),
        "corpus": json.loads((a.work / "corpus" / "sources.json").read_text()),
        "tokens_train_split": int(len(np.load(a.work / "train.npy", mmap_mode="r"))),
        "params": sum(p.numel() for p in model.parameters()),
        "train": {"steps": state["step"], "tokens_seen": state["tokens"], "wall_minutes": round(state["wall"] / 60, 1),
                  "args": state["args"], "last_ce": _last_ce(a.work / "train.log", state["step"])},
        "heldout": {"tokens": scored, "perplexity": round(ppl, 3)},
        "routing": [{"layer": i, "entropy": round(la.entropy, 4), "top2_share": round(la.top_share, 4),
                     "overlap": round(la.overlap, 4), "overlap_if_independent": round(la.overlap_if_independent, 4),
                     "popularity": [round(x / profile.top_k, 4) for x in la.inclusion]}
                    for i, la in enumerate(profile.layers)],
        "cache": cache_figures(routes, model.c.num_experts, sizes),
        "expert_block_bytes_q4_k_m": sizes,
        "samples": [{"prompt": p, "greedy": greedy(model, tok, p)} for p in PROMPTS],
        "runtime_chat": [{"question": q, "answer": runtime_chat(a.work / "pack-Q4_K_M", q)} for q in DEMO_QUESTIONS],
    }
    stats["files"] = {f: (a.out / f"{NAME}-{f}.gguf").stat().st_size for f in ("Q8_0", "Q4_K_M")}
    (a.out / "stats.json").write_text(json.dumps(stats, indent=1, ensure_ascii=False))
    from demo_card import write_card
    write_card(stats, a.out / "MODEL_CARD.md")
    print(json.dumps({k: stats[k] for k in ("train", "heldout", "cache")}, indent=1))
    for r in stats["routing"]:
        print(f"layer {r['layer']}: entropy {r['entropy']:.3f} top2 {r['top2_share']:.3f} "
              f"overlap {r['overlap']:.3f} (independent {r['overlap_if_independent']:.3f})")
    for s in stats["samples"]:
        print(repr(s["prompt"]), "->", repr(s["greedy"]))
