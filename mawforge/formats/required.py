"""The common tensors each architecture's model file reads, per layer: checked at `pack` time
so that a source missing one is refused naming it, instead of packing cleanly and failing
with a KeyError at the first forward pass.

One entry per architecture (llama.cpp names, suffixes after `blk.N.`); the lists follow
mawforge/models/<arch>.py. Optional tensors (biases, a missing attn_v in Gemma 4's k_eq_v
layers, DeepSeek's score-correction bias) are not listed.
"""
from __future__ import annotations

from typing import Callable

from mawforge.errors import FormatError
from mawforge.formats.config import ModelConfig

ATTN = ("attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight")
ROUTER = ("ffn_gate_inp.weight",)
SHARED = ("ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight")


def _llama_like(qk_norm: bool = False, shared: bool = False) -> Callable[[ModelConfig, int], tuple]:
    def need(cfg: ModelConfig, layer: int) -> tuple:
        return (ATTN + ("ffn_norm.weight",) + ROUTER + (("attn_q_norm.weight", "attn_k_norm.weight") if qk_norm else ())
                + (SHARED if shared and cfg.shared_ff else ()))
    return need


def _qwen35moe(cfg: ModelConfig, layer: int) -> tuple:
    full = cfg.extra.get("layer_types", ["full"] * cfg.n_layers)[layer] == "full"
    attn = ATTN[1:] + ("attn_q_norm.weight", "attn_k_norm.weight") if full else ("attn_qkv.weight", "ssm_out.weight")
    return ("attn_norm.weight", "post_attention_norm.weight") + ROUTER + attn


def _qwen3next(cfg: ModelConfig, layer: int) -> tuple:
    if cfg.extra.get("layer_types", ["full"] * cfg.n_layers)[layer] == "full":
        return _qwen35moe(cfg, layer)
    return ("attn_norm.weight", "post_attention_norm.weight") + ROUTER + ("ssm_ba.weight", "ssm_out.weight")


def _gemma4(cfg: ModelConfig, layer: int) -> tuple:
    return ("attn_norm.weight", "post_attention_norm.weight", "attn_q.weight", "attn_k.weight",
            "attn_output.weight", "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight",
            "post_ffw_norm.weight")


def _deepseek2(cfg: ModelConfig, layer: int) -> tuple:
    mla = cfg.extra.get("mla", {})
    q = ("attn_q_a.weight", "attn_q_b.weight") if mla.get("q_lora_rank") else ("attn_q.weight",)
    ffn = ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight") if layer in cfg.extra.get("dense_layers", ()) \
        else ROUTER
    return ("attn_norm.weight", "ffn_norm.weight", "attn_kv_a_mqa.weight", "attn_output.weight") + q + ffn


def _gptoss(cfg: ModelConfig, layer: int) -> tuple:
    return ATTN + ("post_attention_norm.weight", "attn_sinks.weight") + ROUTER


REQUIRED: dict[str, Callable[[ModelConfig, int], tuple]] = {
    "qwen3moe": _llama_like(qk_norm=True), "olmoe": _llama_like(qk_norm=True),
    "mixtral": _llama_like(), "qwen2moe": _llama_like(shared=True),
    "qwen35moe": _qwen35moe, "gemma4": _gemma4, "deepseek2": _deepseek2, "gpt-oss": _gptoss,
    "qwen3next": _qwen3next,
}


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
