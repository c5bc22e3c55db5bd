"""The common tensors each architecture's model file reads, per layer: checked at `pack` time
so that a source missing one is refused naming it, instead of packing cleanly and failing
with a KeyError at the first forward pass.

One entry per architecture (llama.cpp names, suffixes after `blk.N.`): each architecture
file's `required(cfg, layer)` (mawforge/archs/<name>.py), beside the model that reads them.
Optional tensors (biases, a missing attn_v in Gemma 4's k_eq_v layers, DeepSeek's
score-correction bias) are not listed.
"""
from __future__ import annotations

from typing import Callable

from mawforge.archs import ARCHS
from mawforge.errors import FormatError
from mawforge.formats.config import ModelConfig

REQUIRED: dict[str, Callable[[ModelConfig, int], tuple]] = {name: a.required for name, a in ARCHS.items()}


def check_required(cfg: ModelConfig, common) -> None:
    """FormatError naming the first tensor the architecture needs that `common` lacks, or
    whose rank is wrong (a norm that is not 1-D, a projection that is not 2-D)."""
    need = REQUIRED.get(cfg.arch)
    if need is None:
        return
    try:
        for layer in range(cfg.n_layers):
            for suffix in need(cfg, layer):
                name = f"blk.{layer}.{suffix}"
                t = common.get(name)
                if t is None:
                    raise FormatError(f"the source has no {name} tensor, which {cfg.arch} needs "
                                      f"(a truncated conversion or a different architecture?)")
                rank = 1 if suffix.endswith("norm.weight") or suffix == "attn_sinks.weight" else 2
                if len(t.shape) != rank:
                    raise FormatError(f"{name} has shape {list(t.shape)}; {cfg.arch} needs a {rank}-D tensor")
    except (TypeError, IndexError, AttributeError) as e:
        raise FormatError(f"model config: bad family settings ({type(e).__name__}: {e})") from None
    emb = common.get("token_embd.weight")
    if emb is not None and (len(emb.shape) != 2 or emb.shape[-1] != cfg.hidden):
        raise FormatError(f"token_embd.weight has shape {list(emb.shape)}; expected [vocab, {cfg.hidden}]")
