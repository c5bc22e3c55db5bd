"""Qwen3-MoE (HF `qwen3_moe`, GGUF `qwen3moe`): per-head RMSNorm on q and k before RoPE,
softmax router with renormalized top-k, no shared expert."""
from __future__ import annotations

import torch

from mawforge.models.base import MoETransformer, rms_norm


class Qwen3Moe(MoETransformer, arch="qwen3moe"):
    def qk_norm(self, layer: int, q: torch.Tensor, k: torch.Tensor):
        cfg, T, p = self.cfg, q.shape[0], f"blk.{layer}."
        q = rms_norm(q.view(T, cfg.n_heads, cfg.head_dim), self.w.dense(p + "attn_q_norm.weight"), cfg.norm_eps)
        k = rms_norm(k.view(T, cfg.n_kv_heads, cfg.head_dim), self.w.dense(p + "attn_k_norm.weight"), cfg.norm_eps)
        return q.reshape(T, -1), k.reshape(T, -1)
