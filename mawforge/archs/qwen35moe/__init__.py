"""Qwen3.5 / 3.6 MoE (HF `qwen3_5_moe`, GGUF `qwen35moe`): a hybrid stack where most layers mix
tokens with a gated delta-net (models/deltanet.py, fixed recurrent state) and every n-th layer
runs full attention whose q projection also yields a per-channel output gate
(out * sigmoid(gate)), with per-head q/k RMSNorm and RoPE on the first rope_dim dims only.
Every layer's FFN is routed experts (softmax, renormalized top-k) plus a shared expert scaled by
a sigmoid gate. HF RMSNorm weights are zero-centred (x * (1 + w)); llama.cpp's converter stores
1 + w, so Args.norm_offset says which (the delta-net's gated norm is plain in both).

The MTP block (llama.cpp's layer n_layers, kept as common tensors) drafts tokens ahead for
`--speculative mtp`: `mtp_step` is one step (see its docstring), models/mtp.py chains them.

Legend: T tokens in the chunk, C hidden, H heads, G kv heads, D head dim, V vocab, k experts per token.
"""
from __future__ import annotations

from dataclasses import dataclass

from mawforge.archs.spec import Arch, ArchArgs, nextn_names
from mawforge.errors import FormatError


@dataclass(frozen=True)
class Args(ArchArgs):
    rope_dim: int = 0            # RoPE rotates the first rope_dim dims of a head
    linear: dict | None = None   # delta-net heads and dims: k_heads, v_heads, k_dim, v_dim, conv, v_order
    norm_offset: float = 0.0     # 1.0: HF zero-centred norms (x * (1 + w)); 0.0: GGUF stores 1 + w


# ---- readers (torch-free): config.json / GGUF metadata -> ModelConfig field overrides ----
def _qwen35_extra(n_layers: int, full: list[bool], *, kv_heads: int, head_dim: int, rope_dim: int,
                  nk: int, nv: int, dk: int, dv: int, conv: int, norm_offset: float, v_heads: str,
                  mtp: int) -> dict:
    conv_dim = 2 * nk * dk + nv * dv
    kv = [{"kind": "kv", "kv_heads": kv_heads, "head_dim": head_dim} if f else
          {"kind": "recurrent", "state": [[conv_dim, conv - 1], [nv, dk, dv]]} for f in full]
    if len(kv) != n_layers or nv % nk:
        raise FormatError(f"qwen35moe: {len(kv)} layer types for {n_layers} layers, {nv} value heads "
                          f"for {nk} key heads")
    return {"extra": {"layer_types": ["full" if f else "linear" for f in full], "rope_dim": rope_dim,
                      "linear": {"k_heads": nk, "v_heads": nv, "k_dim": dk, "v_dim": dv, "conv": conv,
                                 "v_order": v_heads},
                      "norm_offset": norm_offset, "mtp_layers": mtp, "kv_layers": kv}}


def read_hf(c: dict) -> dict:
    n, hd = int(c["num_hidden_layers"]), int(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])
    rope = c.get("rope_parameters") or {}
    prf = float(rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 0.25)))
    types = c.get("layer_types") or ["full_attention" if (i + 1) % int(c.get("full_attention_interval", 4)) == 0
                                     else "linear_attention" for i in range(n)]
    return _qwen35_extra(n, [t == "full_attention" for t in types], kv_heads=int(c["num_key_value_heads"]),
                         head_dim=hd, rope_dim=int(hd * prf), nk=int(c["linear_num_key_heads"]),
                         nv=int(c["linear_num_value_heads"]), dk=int(c["linear_key_head_dim"]),
                         dv=int(c["linear_value_head_dim"]), conv=int(c["linear_conv_kernel_dim"]),
                         norm_offset=1.0, v_heads="grouped", mtp=int(c.get("mtp_num_hidden_layers", 0) or 0))


def read_gguf(m: dict) -> dict:
    a = "qwen35moe."
    n = int(m[a + "block_count"]) - int(m.get(a + "nextn_predict_layers", 0) or 0)
    every = int(m.get(a + "full_attention_interval", 4))
    nv, ds = int(m[a + "ssm.time_step_rank"]), int(m[a + "ssm.state_size"])
    hd = int(m.get(a + "attention.key_length") or m[a + "embedding_length"] // m[a + "attention.head_count"])
    return _qwen35_extra(n, [(i + 1) % every == 0 for i in range(n)], kv_heads=int(m[a + "attention.head_count_kv"]),
                         head_dim=hd, rope_dim=int(m.get(a + "rope.dimension_count", hd)),
                         nk=int(m[a + "ssm.group_count"]), nv=nv, dk=ds, dv=int(m[a + "ssm.inner_size"]) // nv,
                         conv=int(m[a + "ssm.conv_kernel"]), norm_offset=0.0, v_heads="tiled",
                         mtp=int(m.get(a + "nextn_predict_layers", 0) or 0))


# HF names tried before the shared table (formats/names.py), llama.cpp's names for this arch.
HF_NAMES = (
    (r"layers\.(\d+)\.post_attention_layernorm\.weight", "blk.{0}.post_attention_norm.weight"),
    (r"layers\.(\d+)\.linear_attn\.in_proj_qkv\.weight", "blk.{0}.attn_qkv.weight"),
    (r"layers\.(\d+)\.linear_attn\.in_proj_z\.weight", "blk.{0}.attn_gate.weight"),
    (r"layers\.(\d+)\.linear_attn\.in_proj_b\.weight", "blk.{0}.ssm_beta.weight"),
    (r"layers\.(\d+)\.linear_attn\.in_proj_a\.weight", "blk.{0}.ssm_alpha.weight"),
    (r"layers\.(\d+)\.linear_attn\.conv1d\.weight", "blk.{0}.ssm_conv1d.weight"),
    (r"layers\.(\d+)\.linear_attn\.dt_bias", "blk.{0}.ssm_dt.bias"),
    (r"layers\.(\d+)\.linear_attn\.A_log", "blk.{0}.ssm_a_log"),   # llama.cpp stores -exp(A_log) as ssm_a
    (r"layers\.(\d+)\.linear_attn\.norm\.weight", "blk.{0}.ssm_norm.weight"),
    (r"layers\.(\d+)\.linear_attn\.out_proj\.weight", "blk.{0}.ssm_out.weight"),
) + nextn_names(r"fc\.weight", r"pre_fc_norm_embedding\.weight", r"pre_fc_norm_hidden\.weight",   # MTP block, moved
                 r"mtp_norm\.weight")                                                           # to layer n_layers

# delta-net vectors kept float32
DENSE = ("ssm_a", "ssm_a_log", "ssm_conv1d.weight")


def required(cfg, layer: int) -> tuple:
    full = cfg.args.full_layers()[layer] if cfg.args.layer_types else True
    attn = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "attn_q_norm.weight",
            "attn_k_norm.weight") if full else ("attn_qkv.weight", "ssm_out.weight")
    return ("attn_norm.weight", "post_attention_norm.weight", "ffn_gate_inp.weight") + attn


ARCH = Arch("qwen35moe", ("qwen3_5_moe", "qwen3_5_moe_text"), f"{__name__}.model:Qwen35Moe",
            order=4, args=Args, read_hf=read_hf,
            read_gguf=read_gguf, hf_names=HF_NAMES, dense=DENSE, required=required,
            defaults=dict(qk_norm="head", norm_topk_prob=True, rope_layout="neox"))
