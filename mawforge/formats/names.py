"""Tensor-name tables: HF checkpoint names and GGUF names onto one canonical set.

Canonical names are llama.cpp's GGUF names. Routed experts are not named here as
tensors; they map to (layer, kind[, expert]) and are split into per-expert blocks.
"""
from __future__ import annotations

import re
from typing import NamedTuple

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
    (r"layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.gate_up_proj", "gate_up", True),
    (r"layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.down_proj", "down", True),
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
        if m:
            return ExpertName(int(m.group(1)), kind, None if fused else int(m.group(2)))
    return None


def hf_expert(name: str) -> ExpertName | None:
    return _match_expert(_strip_model(name), _HF_EXPERTS_RE)


def gguf_expert(name: str) -> ExpertName | None:
    return _match_expert(name, _GGUF_EXPERTS_RE)


def hf_common(name: str) -> str | None:
    """Canonical name of an HF tensor, or None when the name is not known."""
    n = _strip_model(name)
    for rx, template in _HF_COMMON_RE:
        m = rx.match(n)
        if m:
            return template.format(*m.groups())
    return None


def _strip_model(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name
