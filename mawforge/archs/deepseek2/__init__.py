"""DeepSeek V2 / V3 (HF `deepseek_v2` / `deepseek_v3`, GGUF `deepseek2`).

Multi-head latent attention, computed in its absorbed form over a compressed KV cache: per
position the cache holds only the normalized latent c (kv_lora_rank) and the shared rope key
(qk_rope), never per-head keys or values. Scores are (q_nope W_uk) . c + q_pe . k_pe; the
output is W_uv (probs . c). W_uk / W_uv come from HF's kv_b_proj ([H*(N+Vd), R], head-major,
keys first) or from GGUF's split attn_k_b [H, R, N] and attn_v_b [H, Vd, R].
Routing: sigmoid (V3) or softmax (V2) scores; V3 adds e_score_correction_bias for the choice
only, limits the choice to the best groups (sum of each group's top-2), renormalizes and
scales by routed_scaling_factor. Shared experts run beside the routed ones; the first
first_k_dense_replace layers have a dense MLP and no routed experts.

DeepSeek-V3's MTP (nextn) layer, llama.cpp's layer n_layers, drafts for `--speculative mtp`:
`mtp_step` is one step (see its docstring), models/mtp.py chains them.

Legend: T tokens, C hidden, H heads, N qk_nope dim, P qk_rope dim, R kv_lora_rank,
Vd v head dim, S cached positions, E experts, G expert groups, k experts per token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mawforge.archs._yarn import _gguf_yarn, _hf_yarn
from mawforge.archs.spec import Arch, ArchArgs, nextn_names
from mawforge.errors import FormatError


@dataclass(frozen=True)
class Args(ArchArgs):
    dense_ff: int = 0
    mla: dict | None = None         # q_lora_rank (0: plain attn_q), kv_lora_rank, qk_nope, qk_rope, v_head_dim
    router: dict | None = None      # gating (sigmoid|softmax), groups, groups_used, group_score (top2sum|max), scale
    rope_scaling: dict | None = None    # YaRN: factor, original_context, beta_fast, beta_slow, attn_factor, ...


# ---- readers (torch-free): config.json / GGUF metadata -> ModelConfig field overrides ----
# kv_layers: one {"kind": "latent", "dim": kv_lora_rank + qk_rope} per layer (the compressed latent
# and the shared rope key, one row per position).
def _deepseek(n: int, heads: int, *, q_rank: int, kv_rank: int, nope: int, rope: int, v: int, dense: int,
              dense_ff: int, moe_ff: int, n_shared: int, router: dict, rope_scaling: dict | None,
              mtp: int) -> dict:
    if router["groups"] < 1 or router["groups_used"] > router["groups"]:
        raise FormatError(f"deepseek2: {router['groups_used']} of {router['groups']} expert groups")
    if rope % 2:
        raise FormatError(f"deepseek2: rope head dim {rope} is odd")
    return {"n_kv_heads": heads, "head_dim": nope + rope, "expert_ff": moe_ff, "shared_ff": moe_ff * n_shared,
            "rope_layout": "norm", "extra": {
                "kv_layers": [{"kind": "latent", "dim": kv_rank + rope}] * n,
                "dense_layers": list(range(min(dense, n))), "dense_ff": dense_ff,
                "mla": {"q_lora_rank": q_rank, "kv_lora_rank": kv_rank, "qk_nope": nope, "qk_rope": rope,
                        "v_head_dim": v},
                "router": router, "rope_scaling": rope_scaling, "mtp_layers": mtp}}


def read_hf(c: dict[str, Any]) -> dict:
    v3 = c.get("model_type") == "deepseek_v3"
    n_experts = int(c.get("n_routed_experts") or c.get("num_experts"))
    if int(c.get("moe_layer_freq") or 1) != 1:
        raise FormatError("deepseek2: moe_layer_freq other than 1 is not supported")
    groups, used = int(c.get("n_group") or 1), int(c.get("topk_group") or 1)
    if not v3 and c.get("topk_method", "greedy") == "greedy":
        groups = used = 1
    if n_experts % groups:
        raise FormatError(f"deepseek2: {n_experts} experts do not split into {groups} groups")
    router = {"gating": "sigmoid" if v3 else "softmax", "groups": groups, "groups_used": used,
              "group_score": "top2sum" if v3 else "max",
              "scale": float(c.get("routed_scaling_factor") or 1.0)}
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    return _deepseek(int(c["num_hidden_layers"]), int(c["num_attention_heads"]), q_rank=int(c.get("q_lora_rank") or 0),
                     kv_rank=int(c["kv_lora_rank"]), nope=int(c["qk_nope_head_dim"]), rope=int(c["qk_rope_head_dim"]),
                     v=int(c["v_head_dim"]), dense=int(c.get("first_k_dense_replace") or 0),
                     dense_ff=int(c["intermediate_size"]), moe_ff=int(c["moe_intermediate_size"]),
                     n_shared=int(c.get("n_shared_experts") or 0), router=router,
                     rope_scaling=_hf_yarn(rope, int(c.get("max_position_embeddings", 4096))),
                     mtp=int(c.get("num_nextn_predict_layers") or 0)) | {
        "norm_topk_prob": bool(c.get("norm_topk_prob", False)) if v3 else False}


def read_gguf(m: dict[str, Any]) -> dict:
    a = "deepseek2."
    rope = int(m[a + "rope.dimension_count"])
    # MLA files (convert_hf_to_gguf since 2025) carry the per-head widths in *_mla keys and the
    # compressed ones in key_length/value_length; older files carry per-head widths only.
    k_mla = m.get(a + "attention.key_length_mla")
    qk = int(k_mla if k_mla is not None else m[a + "attention.key_length"])
    v = int(m.get(a + "attention.value_length_mla") or m[a + "attention.value_length"])
    gating = {1: "softmax", 2: "sigmoid"}.get(int(m.get(a + "expert_gating_func", 1)))
    if gating is None:
        raise FormatError(f"deepseek2: expert_gating_func {m.get(a + 'expert_gating_func')} is not softmax or sigmoid")
    router = {"gating": gating, "groups": int(m.get(a + "expert_group_count", 1) or 1),
              "groups_used": int(m.get(a + "expert_group_used_count", 1) or 1),
              "group_score": "top2sum" if gating == "sigmoid" else "max",
              "scale": float(m.get(a + "expert_weights_scale", 1.0) or 1.0)}
    log_mul = float(m.get(a + "rope.scaling.yarn_log_multiplier", 0.0) or 0.0)
    mtp = int(m.get(a + "nextn_predict_layers", 0) or 0)     # counted in block_count, after the model's layers
    out = _deepseek(int(m[a + "block_count"]) - mtp, int(m[a + "attention.head_count"]),
                    q_rank=int(m.get(a + "attention.q_lora_rank", 0) or 0),
                    kv_rank=int(m[a + "attention.kv_lora_rank"]),
                    nope=qk - rope, rope=rope, v=v, dense=int(m.get(a + "leading_dense_block_count", 0)),
                    dense_ff=int(m[a + "feed_forward_length"]), moe_ff=int(m[a + "expert_feed_forward_length"]),
                    n_shared=int(m.get(a + "expert_shared_count", 0)), router=router,
                    rope_scaling=_gguf_yarn(m, a, log_mul / 0.1), mtp=mtp)
    out["norm_topk_prob"] = bool(m.get(a + "expert_weights_norm", False))
    return out


HF_NAMES = (   # MLA projections, dense first layers, shared experts, router correction bias
    (r"layers\.(\d+)\.self_attn\.q_a_proj\.weight", "blk.{0}.attn_q_a.weight"),
    (r"layers\.(\d+)\.self_attn\.q_a_layernorm\.weight", "blk.{0}.attn_q_a_norm.weight"),
    (r"layers\.(\d+)\.self_attn\.q_b_proj\.weight", "blk.{0}.attn_q_b.weight"),
    (r"layers\.(\d+)\.self_attn\.kv_a_proj_with_mqa\.weight", "blk.{0}.attn_kv_a_mqa.weight"),
    (r"layers\.(\d+)\.self_attn\.kv_a_layernorm\.weight", "blk.{0}.attn_kv_a_norm.weight"),
    (r"layers\.(\d+)\.self_attn\.kv_b_proj\.weight", "blk.{0}.attn_kv_b.weight"),
    (r"layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight", "blk.{0}.ffn_{1}.weight"),
    (r"layers\.(\d+)\.mlp\.shared_experts\.(gate|up|down)_proj\.weight", "blk.{0}.ffn_{1}_shexp.weight"),
    (r"layers\.(\d+)\.mlp\.gate\.e_score_correction_bias", "blk.{0}.exp_probs_b.bias"),
    # DeepSeek-V3 MTP (nextn) layer n_layers, as llama.cpp's gguf-py names it (glm4moe's loader);
    # its embed_tokens and shared_head.head repeat the model's own and are not read
) + nextn_names(r"eh_proj\.weight", r"enorm\.weight", r"hnorm\.weight", r"shared_head\.norm\.weight")

# MLA up-projections, used per head (absorbed)
DENSE = ("attn_kv_b.weight", "attn_k_b.weight", "attn_v_b.weight")


def required(cfg, layer: int) -> tuple:
    mla = cfg.args.mla or {}
    q = ("attn_q_a.weight", "attn_q_b.weight") if mla.get("q_lora_rank") else ("attn_q.weight",)
    ffn = ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight") if layer in cfg.args.dense_layers \
        else ("ffn_gate_inp.weight",)
    return ("attn_norm.weight", "ffn_norm.weight", "attn_kv_a_mqa.weight", "attn_output.weight") + q + ffn


ARCH = Arch("deepseek2", ("deepseek_v3", "deepseek_v2"), f"{__name__}.model:Deepseek2",
            order=6, args=Args, read_hf=read_hf,
            read_gguf=read_gguf, hf_names=HF_NAMES, dense=DENSE, required=required,
            defaults=dict(qk_norm="none", rope_layout="norm"))   # interleaved-pair RoPE on the rope part
