"""GLM-4.5 / 4.6 MoE (HF `glm4_moe`, GGUF `glm4moe`).

Grouped-query attention with q/k/v biases, optional per-head q/k RMSNorm (GLM-4.5 and 4.6 have
it, the Air does not; used where the tensors are, as llama.cpp does) and NEOX RoPE on the first
rope_dim = head_dim * partial_rotary_factor (0.5) dims of each head only. The first
first_k_dense_replace layers run a dense SwiGLU; the others route as DeepSeek-V3: sigmoid
scores, e_score_correction_bias added for the choice only, the choice limited to the best
groups (sum of each group's top-2), top-k of the kept experts, weights renormalized and scaled
by routed_scaling_factor; one shared expert (moe_intermediate_size * n_shared_experts) runs
beside them. The FFN input norm is post_attention_layernorm (llama.cpp's post_attention_norm).

The released checkpoints keep one MTP (nextn) layer after the last layer (llama.cpp's layer
n_layers, packed as common tensors, its routed experts included); `mtp_step` is one step of it
for `--speculative mtp`, models/mtp.py chains them.

Legend: T tokens, C hidden, H heads, G kv heads, D head dim, R rope dims, V vocab, E experts,
k experts per token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mawforge.archs.spec import Arch, ArchArgs, nextn_names
from mawforge.errors import FormatError, UnsupportedError


@dataclass(frozen=True)
class Args(ArchArgs):   # and the shared dense_layers (the first first_k_dense_replace), mtp_layers
    rope_dim: int = 0               # dims of each head RoPE rotates (head_dim * partial_rotary_factor)
    router: dict | None = None      # groups, groups_used (group-limited choice), scale (routed_scaling_factor)


# ---- readers (torch-free): config.json / GGUF metadata -> ModelConfig field overrides ----
def _glm(n: int, dense: int, *, groups: int, groups_used: int, scale: float, rope_dim: int, mtp: int,
         shared_ff: int) -> dict:
    if not 0 <= dense <= n or groups < 1 or not 1 <= groups_used <= groups:
        raise FormatError(f"glm4moe: {dense} dense layers of {n}, {groups_used} of {groups} expert groups")
    if rope_dim % 2:
        raise FormatError(f"glm4moe: rope dims {rope_dim} is odd")
    return {"shared_ff": shared_ff, "extra": {
        "dense_layers": list(range(dense)), "rope_dim": rope_dim, "mtp_layers": mtp,
        "router": {"groups": groups, "groups_used": groups_used, "scale": scale}}}


def read_hf(c: dict[str, Any]) -> dict:
    hd = int(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    if rope.get("rope_type", "default") != "default":
        raise UnsupportedError(f"glm4moe: rope type {rope.get('rope_type')!r} is not supported (default only)")
    prf = float(rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 0.5)))
    return _glm(int(c["num_hidden_layers"]), int(c.get("first_k_dense_replace", 1)),
                groups=int(c.get("n_group") or 1), groups_used=int(c.get("topk_group") or 1),
                scale=float(c.get("routed_scaling_factor") or 1.0), rope_dim=int(hd * prf),
                mtp=int(c.get("num_nextn_predict_layers") or 0),
                shared_ff=int(c["moe_intermediate_size"]) * int(c.get("n_shared_experts", 1) or 0)) | {
        "qkv_bias": bool(c.get("attention_bias", False)), "norm_topk_prob": bool(c.get("norm_topk_prob", True))}


def read_gguf(m: dict[str, Any]) -> dict:
    a = "glm4moe."
    if int(m.get(a + "expert_gating_func", 2)) != 2:
        raise FormatError(f"glm4moe: expert_gating_func {m.get(a + 'expert_gating_func')} is not sigmoid (2)")
    if any(m.get(a + "rope.dimension_sections") or ()):
        raise UnsupportedError("glm4moe with M-RoPE sections (a GLM-4.5V conversion) is not supported; "
                               "the text models have none")
    mtp = int(m.get(a + "nextn_predict_layers", 0) or 0)     # counted in block_count, after the model's layers
    hd = int(m.get(a + "attention.key_length") or m[a + "embedding_length"] // m[a + "attention.head_count"])
    return _glm(int(m[a + "block_count"]) - mtp, int(m.get(a + "leading_dense_block_count", 0) or 0),
                groups=max(1, int(m.get(a + "expert_group_count", 1) or 1)),
                groups_used=max(1, int(m.get(a + "expert_group_used_count", 1) or 1)),
                scale=float(m.get(a + "expert_weights_scale", 1.0) or 1.0),
                rope_dim=int(m.get(a + "rope.dimension_count") or hd // 2), mtp=mtp,
                shared_ff=int(m[a + "expert_feed_forward_length"]) * int(m.get(a + "expert_shared_count", 0) or 0))


HF_NAMES = (   # dense first layers, shared expert, router correction bias, the MTP layer n_layers
    (r"layers\.(\d+)\.post_attention_layernorm\.weight", "blk.{0}.post_attention_norm.weight"),
    (r"layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight", "blk.{0}.ffn_{1}.weight"),
    (r"layers\.(\d+)\.mlp\.shared_experts\.(gate|up|down)_proj\.weight", "blk.{0}.ffn_{1}_shexp.weight"),
    (r"layers\.(\d+)\.mlp\.gate\.e_score_correction_bias", "blk.{0}.exp_probs_b.bias"),
    # the MTP layer's own tensors; its embed_tokens and shared_head.head repeat the model's and are not read
) + nextn_names(r"eh_proj\.weight", r"enorm\.weight", r"hnorm\.weight", r"shared_head\.norm\.weight")

ATTN = ("attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
        "post_attention_norm.weight")


def required(cfg, layer: int) -> tuple:
    if layer in cfg.args.dense_layers:
        return ATTN + ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
    return ATTN + ("ffn_gate_inp.weight",) + (("ffn_gate_shexp.weight", "ffn_up_shexp.weight",
                                                "ffn_down_shexp.weight") if cfg.shared_ff else ())


ARCH = Arch("glm4moe", ("glm4_moe",), f"{__name__}.model:Glm4Moe",
            order=8, args=Args, read_hf=read_hf, read_gguf=read_gguf,
            hf_names=HF_NAMES, required=required,
            defaults=dict(qk_norm="none", norm_topk_prob=True, rope_layout="neox", qkv_bias=True))
