"""Gemma 4 MoE (HF `gemma4` / `gemma4_text` with enable_moe_block, GGUF `gemma4`), e.g. 26B-A4B.

Per layer: sliding-window or global attention (Args.layer_types); q and k get per-head
RMSNorm, v a weightless RMSNorm, the softmax scale is 1; global layers have their own head dim
and kv heads, may reuse k as v (attention_k_eq_v), and use proportional RoPE (only the first
rope_pairs frequency pairs rotate; GGUF says the same with rope_freqs = 1e30 for the rest).
Attention output and both FFN branches are RMS-normed before their residual add; the FFN is a
dense GELU-tanh MLP plus routed GELU-tanh experts. The router normalizes the residual stream
(no weight), scales it by `ffn_gate_inp.scale` and hidden^-0.5, softmaxes, takes renormalized
top-k and multiplies by a per-expert scale. Embeddings are multiplied by sqrt(hidden); each layer's
output by layer_output_scale; final logits are soft-capped. Norm weights are plain (not 1 + w).

Legend: T tokens in the chunk, C hidden, H heads, G kv heads, D head dim, V vocab, k experts per token.
"""
from __future__ import annotations

from dataclasses import dataclass

from mawforge.archs.spec import Arch, ArchArgs
from mawforge.errors import FormatError, UnsupportedError


@dataclass(frozen=True)
class Args(ArchArgs):
    sliding_window: int = 0
    full: dict | None = None                # global layers: kv_heads, head_dim, rope_base, rope_pairs, k_eq_v
    final_logit_softcapping: float | None = None


# ---- readers (torch-free): config.json / GGUF metadata -> ModelConfig field overrides ----
def _gemma4_extra(full: list[bool], *, heads: int, kv_s: int, kv_f: int, d_s: int, d_f: int, window: int,
                  theta_s: float, theta_f: float, pairs_f: int, softcap, k_eq_v: bool) -> dict:
    if heads % kv_f:
        raise FormatError(f"gemma4: {heads} heads not divisible by {kv_f} global kv heads")
    kv = [{"kind": "kv", "kv_heads": kv_f, "head_dim": d_f} if f else
          {"kind": "kv", "kv_heads": kv_s, "head_dim": d_s, "window": window} for f in full]
    return {"rope_base": theta_s, "extra": {
        "layer_types": ["full" if f else "sliding" for f in full], "sliding_window": window,
        "full": {"kv_heads": kv_f, "head_dim": d_f, "rope_base": theta_f, "rope_pairs": pairs_f, "k_eq_v": k_eq_v},
        "final_logit_softcapping": softcap, "kv_layers": kv}}


def read_hf(c: dict) -> dict:
    if int(c.get("hidden_size_per_layer_input") or 0) or int(c.get("num_kv_shared_layers") or 0):
        raise UnsupportedError("gemma4 with per-layer embeddings or shared KV layers (the dense E2B/E4B "
                               "models) is not supported; the MoE models have neither")
    n, d_s = int(c["num_hidden_layers"]), int(c["head_dim"])
    full = [t == "full_attention" for t in c["layer_types"]]
    plc = {int(k): v for k, v in (c.get("per_layer_config") or {}).items()}
    g = next((plc[i] for i in range(n) if full[i] and i in plc), {})
    d_f = int(g.get("head_dim") or c.get("global_head_dim") or d_s)
    kv_f = int(g.get("num_key_value_heads") or c.get("num_global_key_value_heads") or c["num_key_value_heads"])
    rp = c.get("rope_parameters") or {}
    rs, rf = rp.get("sliding_attention") or {}, rp.get("full_attention") or {}
    pairs = int(float(rf.get("partial_rotary_factor", 1.0)) * d_f // 2) if rf.get("rope_type") == "proportional" \
        else int(d_f * float(rf.get("partial_rotary_factor", 1.0))) // 2
    return _gemma4_extra(full, heads=int(c["num_attention_heads"]), kv_s=int(c["num_key_value_heads"]), kv_f=kv_f,
                         d_s=d_s, d_f=d_f, window=int(c["sliding_window"]),
                         theta_s=float(rs.get("rope_theta", 10000.0)), theta_f=float(rf.get("rope_theta", 1e6)),
                         pairs_f=pairs,
                         softcap=c.get("final_logit_softcapping"), k_eq_v=bool(c.get("attention_k_eq_v")))


def read_gguf(m: dict) -> dict:
    a = "gemma4."
    n = int(m[a + "block_count"])
    swa = m.get(a + "attention.sliding_window_pattern")
    full = [not bool(x) for x in swa] if isinstance(swa, list) else [(i + 1) % 6 == 0 for i in range(n)]
    kv = m[a + "attention.head_count_kv"]
    kvs = kv if isinstance(kv, list) else [kv] * n
    d_f, d_s = int(m[a + "attention.key_length"]), int(m[a + "attention.key_length_swa"])
    i_f, i_s = full.index(True), full.index(False)
    return _gemma4_extra(full, heads=int(m[a + "attention.head_count"]), kv_s=int(kvs[i_s]), kv_f=int(kvs[i_f]),
                         d_s=d_s, d_f=d_f, window=int(m[a + "attention.sliding_window"]),
                         theta_s=float(m.get(a + "rope.freq_base_swa", 10000.0)),
                         theta_f=float(m.get(a + "rope.freq_base", 1e6)), pairs_f=d_f // 2,
                         softcap=m.get(a + "final_logit_softcapping"), k_eq_v=False) | {
        "n_kv_heads": int(kvs[i_s]), "head_dim": d_s}


HF_NAMES = (
    (r"layers\.(\d+)\.post_attention_layernorm\.weight", "blk.{0}.post_attention_norm.weight"),
    (r"layers\.(\d+)\.pre_feedforward_layernorm\.weight", "blk.{0}.ffn_norm.weight"),
    (r"layers\.(\d+)\.post_feedforward_layernorm\.weight", "blk.{0}.post_ffw_norm.weight"),
    (r"layers\.(\d+)\.pre_feedforward_layernorm_2\.weight", "blk.{0}.pre_ffw_norm_2.weight"),
    (r"layers\.(\d+)\.post_feedforward_layernorm_1\.weight", "blk.{0}.post_ffw_norm_1.weight"),
    (r"layers\.(\d+)\.post_feedforward_layernorm_2\.weight", "blk.{0}.post_ffw_norm_2.weight"),
    (r"layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight", "blk.{0}.ffn_{1}.weight"),
    (r"layers\.(\d+)\.router\.proj\.weight", "blk.{0}.ffn_gate_inp.weight"),
    (r"layers\.(\d+)\.router\.scale", "blk.{0}.ffn_gate_inp.scale"),
    (r"layers\.(\d+)\.router\.per_expert_scale", "blk.{0}.ffn_down_exps.scale"),
    (r"layers\.(\d+)\.layer_scalar", "blk.{0}.layer_output_scale.weight"),
)

DENSE = ("_norm_1.weight", "_norm_2.weight", ".scale", "layer_output_scale.weight", "rope_freqs.weight")


def required(cfg, layer: int) -> tuple:
    return ("attn_norm.weight", "post_attention_norm.weight", "attn_q.weight", "attn_k.weight",
            "attn_output.weight", "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight",
            "post_ffw_norm.weight")


ARCH = Arch("gemma4", ("gemma4", "gemma4_text"), f"{__name__}.model:Gemma4",
            order=5, args=Args, read_hf=read_hf, read_gguf=read_gguf,
            hf_names=HF_NAMES, dense=DENSE, required=required,
            defaults=dict(qk_norm="head", norm_topk_prob=True, rope_layout="neox"))
