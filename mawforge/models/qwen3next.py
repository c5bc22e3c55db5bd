"""Qwen3-Next (HF `qwen3_next`, GGUF `qwen3next`): the hybrid stack Qwen3.5 MoE inherited, so the
model is Qwen35Moe (gated full attention with partial NEOX RoPE and per-head q/k norm, the gated
delta-net of models/deltanet.py with its state and rollback, softmax top-k experts plus a
sigmoid-gated shared expert, zero-centred (1 + w) RMSNorm) with two differences, both in the
delta-net's input projections and both handled here:

  - The checkpoint fuses them per key head. HF in_proj_qkvz rows are, for each key head,
    [q (Dk), k (Dk), v (r*Dv), z (r*Dv)]; llama.cpp's converter regroups them into attn_qkv
    ([all q | all k | all v]) and attn_gate, while older GGUFs keep the fused tensor as ssm_in.
    HF in_proj_ba and GGUF ssm_ba are the same tensor: per key head [b (r), a (r)].
    The HF reader names in_proj_qkvz ssm_in, so one split serves HF and legacy GGUF sources.
  - Value heads stay grouped by key head (v head j reads k head j // r) in both formats; Qwen3.5
    GGUFs tile them instead. config.extra["linear"]["v_order"] says which.

Legend: T tokens in the chunk, C hidden, Hk/Hv key/value heads, Dk/Dv their dims, r = Hv/Hk,
Ch conv channels (2*Hk*Dk + Hv*Dv).
"""
from __future__ import annotations

import torch

from mawforge.kernels import linear
from mawforge.models.deltanet import DeltaNetMixer
from mawforge.models.qwen35moe import Qwen35Moe


class FusedDeltaNetMixer(DeltaNetMixer):
    """DeltaNetMixer reading Qwen3-Next's fused projections (ssm_in or attn_qkv + attn_gate, ssm_ba)."""

    def project(self, p: str, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        T, hk, hv, dk, dv = x.shape[0], self.hk, self.hv, self.dk, self.dv
        r = hv // hk
        if self.w.has(p + "ssm_in.weight"):
            y = linear(x, self.w.packed(p + "ssm_in.weight")).float().view(T, hk, 2 * dk + 2 * r * dv)
            q, k, v, z = y.split((dk, dk, r * dv, r * dv), dim=-1)                 # per key head
            mixed = torch.cat((q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)), dim=-1)   # [T, Ch]
        else:
            mixed = linear(x, self.w.packed(p + "attn_qkv.weight")).float()
            z = linear(x, self.w.packed(p + "attn_gate.weight")).float()
        ba = linear(x, self.w.packed(p + "ssm_ba.weight")).float().view(T, hk, 2 * r)
        b, a = ba[..., :r].reshape(T, hv), ba[..., r:].reshape(T, hv)              # [T, Hv]
        return mixed, z.reshape(T, hv, dv), b, a


class Qwen3Next(Qwen35Moe, arch="qwen3next"):
    def __init__(self, cfg, weights, experts, device):
        super().__init__(cfg, weights, experts, device)
        self.mixer = FusedDeltaNetMixer(weights, cfg.extra["linear"], cfg.norm_eps)
