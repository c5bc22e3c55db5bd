"""The demo model shipped with MawForge: a 4-layer, 16-expert, top-2 Qwen3-MoE trained on the
King James Bible and the Python 3.11 documentation, so `make demo` prints English rather than
random tokens, and the tests and `mawforge synth` have a trained model's routing to compare
against. MODEL_CARD.md says how it was made; scripts/train_demo_model.py remakes it."""
from __future__ import annotations

from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parent
NAME = "mawforge-demo-qwen3moe"
FTYPES = ("Q8_0", "Q4_K_M")
ROUTING_PROFILE = DEMO_DIR / "routing-profile.json"
STATS = DEMO_DIR / "stats.json"


def demo_gguf(ftype: str = "Q4_K_M") -> Path:
    """Path of the shipped GGUF file in `ftype` (Q8_0 or Q4_K_M)."""
    if ftype not in FTYPES:
        raise ValueError(f"the demo model ships as {' or '.join(FTYPES)}, not {ftype}")
    return DEMO_DIR / f"{NAME}-{ftype}.gguf"
