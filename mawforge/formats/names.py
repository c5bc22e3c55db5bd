"""Tensor-name tables: HF checkpoint names and GGUF names onto one canonical set.

Canonical names are llama.cpp's GGUF names. Routed experts are not named here as
tensors; they map to (layer, kind[, expert]) and are split into per-expert blocks. The names
one architecture adds or renames live in its file (mawforge/archs/<name>.py, HF_NAMES).
"""
from __future__ import annotations

import re
from typing import NamedTuple

from mawforge.archs import ARCHS

# HF (after stripping a leading "model.") -> canonical, shared by all archs.
_HF_COMMON = [
    (r"embed_tokens\.weight", "token_embd.weight"),
    (r"norm\.weight", "output_norm.weight"),
    (r"lm_head\.weight", "output.weight"),
    (r"layers\.(\d+)\.input_layernorm\.weight", "blk.{0}.attn_norm.weight"),
    (r"layers\.(\d+)\.post_attention_layernorm\.weight", "blk.{0}.ffn_norm.weight"),
    (r"layers\.(\d+)\.self_attn\.q_proj\.(weight|bias)", "blk.{0}.attn_q.{1}"),
    (r"layers\.(\d+)\.self_attn\.k_proj\.(weight|bias)", "blk.{0}.attn_k.{1}"),
    (r"layers\.(\d+)\.self_attn\.v_proj\.(weight|bias)", "blk.{0}.attn_v.{1}"),
    (r"layers\.(\d+)\.self_attn\.o_proj\.weight", "blk.{0}.attn_output.weight"),
    (r"layers\.(\d+)\.self_attn\.q_norm\.weight", "blk.{0}.attn_q_norm.weight"),
    (r"layers\.(\d+)\.self_attn\.k_norm\.weight", "blk.{0}.attn_k_norm.weight"),
    (r"layers\.(\d+)\.(?:mlp|block_sparse_moe)\.gate\.weight", "blk.{0}.ffn_gate_inp.weight"),
    (r"layers\.(\d+)\.mlp\.shared_expert\.gate_proj\.weight", "blk.{0}.ffn_gate_shexp.weight"),
    (r"layers\.(\d+)\.mlp\.shared_expert\.up_proj\.weight", "blk.{0}.ffn_up_shexp.weight"),
    (r"layers\.(\d+)\.mlp\.shared_expert\.down_proj\.weight", "blk.{0}.ffn_down_shexp.weight"),
    (r"layers\.(\d+)\.mlp\.shared_expert_gate\.weight", "blk.{0}.ffn_gate_inp_shexp.weight"),
]

# HF routed experts: (pattern, kind, fused). Fused = one 3-D parameter for all experts.
_HF_EXPERTS = [
    # llama4: feed_forward
    (r"layers\.(\d+)\.(?:mlp|block_sparse_moe|feed_forward)\.experts\.gate_up_proj", "gate_up", True),
    (r"layers\.(\d+)\.(?:mlp|block_sparse_moe|feed_forward)\.experts\.down_proj", "down", True),
    (r"layers\.(\d+)\.experts\.gate_up_proj", "gate_up", True),    # gemma4: experts beside the MLP
    (r"layers\.(\d+)\.experts\.down_proj", "down", True),
    (r"layers\.(\d+)\.mlp\.experts\.gate_up_proj_bias", "gate_up_bias", True),   # gpt-oss [E, 2F]
    (r"layers\.(\d+)\.mlp\.experts\.down_proj_bias", "down_bias", True),         # gpt-oss [E, H]
    (r"layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.gate_proj\.weight", "gate", False),
    (r"layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.up_proj\.weight", "up", False),
    (r"layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.down_proj\.weight", "down", False),
    (r"layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.w1\.weight", "gate", False),
    (r"layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.w3\.weight", "up", False),
    (r"layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.w2\.weight", "down", False),
]

# GGUF routed experts: merged 3-D tensors, or one tensor per expert (older Mixtral files).
_GGUF_EXPERTS = [
    (r"blk\.(\d+)\.ffn_gate_exps\.weight", "gate", True),
    (r"blk\.(\d+)\.ffn_up_exps\.weight", "up", True),
    (r"blk\.(\d+)\.ffn_down_exps\.weight", "down", True),
    (r"blk\.(\d+)\.ffn_gate_up_exps\.weight", "gate_up", True),
    (r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.bias", "{}_bias", True),     # gpt-oss [E, F] / [E, H]
    (r"blk\.(\d+)\.ffn_gate\.(\d+)\.weight", "gate", False),
    (r"blk\.(\d+)\.ffn_up\.(\d+)\.weight", "up", False),
    (r"blk\.(\d+)\.ffn_down\.(\d+)\.weight", "down", False),
]


class ExpertName(NamedTuple):
    layer: int
    kind: str
    expert: int | None   # None for a fused tensor holding every expert


def _compile(table):
    return [(re.compile(p + r"$"), *rest) for p, *rest in table]


_HF_COMMON_RE = _compile(_HF_COMMON)
_HF_EXPERTS_RE = _compile(_HF_EXPERTS)
_GGUF_EXPERTS_RE = _compile(_GGUF_EXPERTS)


def _match_expert(name: str, table) -> ExpertName | None:
    for rx, kind, fused in table:
        m = rx.match(name)
        if m and "{}" in kind:                     # the role is part of the name (fused only)
            return ExpertName(int(m.group(1)), kind.format(m.group(2)), None)
        if m:
            return ExpertName(int(m.group(1)), kind, None if fused else int(m.group(2)))
    return None


def hf_expert(name: str, arch: str | None = None) -> ExpertName | None:
    en = _match_expert(_strip_model(name), _HF_EXPERTS_RE)
    kinds = ARCHS[arch].hf_expert_kinds if arch in ARCHS else None
    return en._replace(kind=kinds.get(en.kind, en.kind)) if en is not None and kinds else en


def gguf_expert(name: str) -> ExpertName | None:
    return _match_expert(name, _GGUF_EXPERTS_RE)


def hf_common(name: str, arch: str | None = None) -> str | None:
    """Canonical name of an HF tensor, or None when the name is not known."""
    n = _strip_model(name)
    own = ARCHS[arch].hf_name_table() if arch in ARCHS else []
    for rx, template in own + _HF_COMMON_RE:
        m = rx.match(n)
        if m:
            return template.format(*m.groups())
    return None


def _strip_model(name: str) -> str:
    name = name[len("model."):] if name.startswith("model.") else name
    # multimodal checkpoints keep the text model under language_model. (Qwen3.5, Gemma 4:
    # model.language_model.layers...; Llama 4: language_model.model.layers..., language_model.lm_head)
    name = name[len("language_model."):] if name.startswith("language_model.") else name
    return name[len("model."):] if name.startswith("model.") else name


def hf_mtp(name: str, n_layers: int) -> str:
    """Qwen3.5 keeps its multi-token-prediction block under mtp.*; llama.cpp appends it as layer
    n_layers. Rename so the common and expert tables apply (mtp.norm -> layers.N.mtp_norm)."""
    if not name.startswith("mtp."):
        return name
    rest = name[len("mtp."):]
    if rest.startswith("layers."):
        i, _, tail = rest[len("layers."):].partition(".")
        return f"layers.{n_layers + int(i)}.{tail}"
    return f"layers.{n_layers}.{'mtp_norm.weight' if rest == 'norm.weight' else rest}"
