"""Train the demo model: a small Qwen3-MoE that speaks English, shipped in mawforge/demo/.

    python scripts/train_demo_model.py all   [--work work/demo-model] [--max-minutes 75]
    python scripts/train_demo_model.py corpus|tokenizer|train|export|stats

Steps (each reads the previous step's output under --work; `all` runs what is missing):
    corpus     install the Debian packages, extract and clean the text (scripts/demo_corpus.py)
    tokenizer  a 4096-token byte-level BPE (Qwen2 split regex) trained on the train split;
               token ids for both splits as uint16 arrays
    train      torch on CPU, one thread by default, seeded; a checkpoint every --ckpt-every
               steps and on exit, so a killed run resumes where it stopped with the same batches
    export     HF directory (config, safetensors, tokenizer) -> F32 GGUF through the project's
               fixture writer -> Q8_0 and Q4_K_M through llama.cpp's own quantizer
    stats      held-out perplexity, samples, routing statistics and the synth routing profile
               (scripts/demo_stats.py)

Why one thread: the machine it was trained on had two cores shared with other work.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import demo_corpus  # noqa: E402
from demo_moe import DemoConfig, DemoMoe  # noqa: E402

SEQ, BATCH, VOCAB = 256, 16, 4096


def step_corpus(a) -> None:
    meta = demo_corpus.build_corpus(a.work / "corpus", seed=a.seed)
    print(json.dumps(meta, indent=2))


def step_tokenizer(a) -> None:
    os.environ.setdefault("RAYON_NUM_THREADS", str(a.threads))
    from mawforge.fixtures.tokenizer import ByteBpeTokenizer
    corpus = a.work / "corpus"
    text = (corpus / "train.txt").read_text()
    specials = ByteBpeTokenizer.SPECIALS
    lines = [ln for doc in text.split(demo_corpus.EOT) for ln in doc.splitlines(keepends=True)]
    lines = [ln for ln in lines if not any(s in ln for s in specials)]
    tok = ByteBpeTokenizer.train(VOCAB, lines)
    tok.save_hf(a.work / "tokenizer")
    for split in ("train", "heldout"):
        docs = (corpus / f"{split}.txt").read_text()
        ids = np.array(tok.tokenizer.encode(docs).ids, dtype=np.uint16)
        np.save(a.work / f"{split}.npy", ids)
        print(f"{split}: {len(docs)} chars -> {len(ids)} tokens ({len(docs) / len(ids):.2f} chars/token)")


def _batch(data: np.ndarray, step: int, seed: int) -> torch.Tensor:
    """Random windows, a function of (seed, step) only, so a resumed run sees the same batches."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(data) - SEQ - 1, BATCH)
    return torch.from_numpy(np.stack([data[s:s + SEQ + 1] for s in starts]).astype(np.int64))


def _lr(step: int, a) -> float:
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    frac = min(1.0, (step - a.warmup) / max(1, a.steps - a.warmup))
    return a.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def step_train(a) -> None:
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    data = np.load(a.work / "train.npy")
    model = DemoMoe(DemoConfig())
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    ckpt, log = a.work / "ckpt.pt", a.work / "train.log"
    step, tokens, wall = 0, 0, 0.0
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step, tokens, wall = state["step"], state["tokens"], state["wall"]
        print(f"resumed at step {step}")

    def save():
        tmp = ckpt.with_suffix(".tmp")
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "tokens": tokens,
                    "wall": wall, "args": {k: str(v) for k, v in vars(a).items()}}, tmp)
        os.replace(tmp, ckpt)

    start, t_last, deadline = time.time(), time.time(), time.time() + a.max_minutes * 60
    model.train()
    with log.open("a") as f:
        while step < a.steps and time.time() < deadline:
            for g in opt.param_groups:
                g["lr"] = _lr(step, a)
            batch = _batch(data, step, a.seed)
            logits, aux, _ = model(batch[:, :-1])
            ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
            loss = ce + a.aux_coef * aux
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step, tokens = step + 1, tokens + BATCH * SEQ
            if step % 10 == 0:
                now = time.time()
                wall += now - t_last
                t_last = now
                f.write(json.dumps({"step": step, "ce": round(ce.item(), 4), "aux": round(float(aux.detach()), 4),
                                    "lr": round(_lr(step, a), 6), "tokens": tokens, "wall_s": round(wall, 1)}) + "\n")
                f.flush()
            if step % a.ckpt_every == 0:
                save()
        wall += time.time() - t_last
        save()
    print(f"stopped at step {step}/{a.steps}, {tokens} tokens, {wall / 60:.1f} min this far "
          f"({time.time() - start:.0f} s this run)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("step", choices=["corpus", "tokenizer", "train", "export", "stats", "all"])
    p.add_argument("--work", type=Path, default=Path("work/demo-model"))
    p.add_argument("--out", type=Path, default=Path("mawforge/demo"), help="where export/stats put the shipped files")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--aux-coef", type=float, default=0.01)
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--max-minutes", type=float, default=75.0, help="stop (with a checkpoint) after this long")
    a = p.parse_args(argv)
    a.work.mkdir(parents=True, exist_ok=True)
    steps = {"corpus": step_corpus, "tokenizer": step_tokenizer, "train": step_train}
    try:
        import demo_export
        steps |= {"export": demo_export.step_export}
        import demo_stats
        steps |= {"stats": demo_stats.step_stats}
    except ImportError:
        pass
    if a.step != "all":
        steps[a.step](a)
        return 0
    if not (a.work / "corpus" / "train.txt").exists():
        step_corpus(a)
    if not (a.work / "train.npy").exists():
        step_tokenizer(a)
    for name in ("train", "export", "stats"):
        steps[name](a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
