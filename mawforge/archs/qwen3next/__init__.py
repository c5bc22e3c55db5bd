"""Qwen3-Next (HF `qwen3_next`, GGUF `qwen3next`): the hybrid stack Qwen3.5 MoE inherited, so the
model is qwen35moe's (gated full attention with partial NEOX RoPE and per-head q/k norm, the gated
delta-net of models/deltanet.py with its state and rollback, softmax top-k experts plus a
sigmoid-gated shared expert, zero-centred (1 + w) RMSNorm, one MTP block) with two differences,
both in the delta-net's input projections:

  - The checkpoint fuses them per key head. HF in_proj_qkvz rows are, for each key head,
    [q (Dk), k (Dk), v (r*Dv), z (r*Dv)]; llama.cpp's converter regroups them into attn_qkv
    ([all q | all k | all v]) and attn_gate, while older GGUFs keep the fused tensor as ssm_in.
    HF in_proj_ba and GGUF ssm_ba are the same tensor: per key head [b (r), a (r)].
    HF_NAMES names in_proj_qkvz ssm_in, so one split (DeltaNetMixer.project, chosen by the names
    present) serves HF and legacy GGUF sources.
  - Value heads stay grouped by key head (v head j reads k head j // r) in both formats; Qwen3.5
    GGUFs tile them instead (Args.linear["v_order"]).

Every layer is MoE: HF's mlp_only_layers / decoder_sparse_step are refused (llama.cpp requires a
router in every qwen3next layer; the released models have one). config.json does not count the
MTP block (llama.cpp's converter counts mtp.layers.*): the model drafts with it where its tensors are.

Legend: T tokens in the chunk, C hidden, Hk/Hv key/value heads, Dk/Dv their dims, r = Hv/Hk.
"""
from __future__ import annotations

from mawforge.archs import qwen35moe as q35
from mawforge.archs.spec import Arch
from mawforge.errors import UnsupportedError

Args = q35.Args


# ---- readers (torch-free) ------------------------------------------------------------------
def read_hf(c: dict) -> dict:
    step, dense = int(c.get("decoder_sparse_step") or 1), list(c.get("mlp_only_layers") or [])
    if dense or step != 1:
        raise UnsupportedError(f"qwen3_next with dense MLP layers (mlp_only_layers {dense}, decoder_sparse_step "
                               f"{step}) is not supported; the released models are MoE in every layer")
    return q35.read_hf({**c, "mtp_num_hidden_layers": c.get("mtp_num_hidden_layers") or 1})


def read_gguf(m: dict) -> dict:
    """llama.cpp's qwen3next keys; recurrent layers from attention.recurrent_layers when the
    converter wrote it, else every full_attention_interval-th layer is full attention."""
    a = "qwen3next."
    mtp = int(m.get(a + "nextn_predict_layers", 0) or 0)
    n = int(m[a + "block_count"]) - mtp
    rec = m.get(a + "attention.recurrent_layers")
    every = int(m.get(a + "full_attention_interval", 4))
    full = [not bool(x) for x in rec[:n]] if isinstance(rec, list) else [(i + 1) % every == 0 for i in range(n)]
    nv, ds = int(m[a + "ssm.time_step_rank"]), int(m[a + "ssm.state_size"])
    hd = int(m.get(a + "attention.key_length") or m[a + "embedding_length"] // m[a + "attention.head_count"])
    return q35._qwen35_extra(n, full, kv_heads=int(m[a + "attention.head_count_kv"]), head_dim=hd,
                             rope_dim=int(m.get(a + "rope.dimension_count", hd)), nk=int(m[a + "ssm.group_count"]),
                             nv=nv, dk=ds, dv=int(m[a + "ssm.inner_size"]) // nv, conv=int(m[a + "ssm.conv_kernel"]),
                             norm_offset=0.0, v_heads="grouped", mtp=mtp)


# HF names: Qwen3.5's table with its four split delta-net projections replaced by the two fused ones
HF_NAMES = ((r"layers\.(\d+)\.linear_attn\.in_proj_qkvz\.weight", "blk.{0}.ssm_in.weight"),
            (r"layers\.(\d+)\.linear_attn\.in_proj_ba\.weight", "blk.{0}.ssm_ba.weight"),
            ) + tuple((p, t) for p, t in q35.HF_NAMES if "in_proj_" not in p)


def required(cfg, layer: int) -> tuple:
    if not cfg.args.layer_types or cfg.args.full_layers()[layer]:
        return q35.required(cfg, layer)            # gated attention: as Qwen3.5
    # delta-net: ssm_in or attn_qkv + attn_gate, whichever the source has; ssm_ba in both formats
    return ("attn_norm.weight", "post_attention_norm.weight", "ffn_gate_inp.weight", "ssm_ba.weight", "ssm_out.weight")


ARCH = Arch("qwen3next", ("qwen3_next",), f"{__name__}.model:Qwen3Next",
            order=9, args=Args, read_hf=read_hf, read_gguf=read_gguf,
            hf_names=HF_NAMES, dense=q35.DENSE, required=required, defaults=dict(q35.ARCH.defaults))
