"""A training-speed Qwen3-MoE in plain torch, numerically the model transformers'
Qwen3MoeForCausalLM computes, with its parameters under the HF checkpoint names
(per-expert `mlp.experts.{e}.{gate,up,down}_proj.weight`), so `state_dict()` saves as an HF
directory that transformers and the project's GGUF writer both read.

Why not train Qwen3MoeForCausalLM itself: its expert loop and generic attention cost ~2x per
step on one CPU thread; here each expert runs once per step on the tokens routed to it.
tests/test_demo_model.py checks the two agree on the committed weights.

Legend: B batch, T tokens per row, N = B*T, H hidden, E experts, K top-k, F expert FF, D head dim.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class DemoConfig:
    vocab_size: int = 4096
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    num_experts: int = 16
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 256     # the row length of ffn_down: K-quants need a multiple of 256
    max_position_embeddings: int = 2048
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6

    def hf_config(self, bos: int, eos: int, pad: int) -> dict:
        c = asdict(self)
        theta = c.pop("rope_theta")
        return c | {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                    "intermediate_size": 512, "decoder_sparse_step": 1, "mlp_only_layers": [],
                    "norm_topk_prob": True, "tie_word_embeddings": False, "attention_bias": False,
                    "hidden_act": "silu", "initializer_range": 0.02, "use_cache": True,
                    "rope_parameters": {"rope_type": "default", "rope_theta": theta},
                    "bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad,
                    "output_router_logits": False, "dtype": "float32"}


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(n)), eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Attention(nn.Module):
    def __init__(self, c: DemoConfig):
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def forward(self, x, cos, sin):                                  # x [B, T, H]
        c, (b, t, _) = self.c, x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, -1, c.head_dim)).transpose(1, 2)  # [B, heads, T, D]
        k = self.k_norm(self.k_proj(x).view(b, t, -1, c.head_dim)).transpose(1, 2)  # [B, kv, T, D]
        v = self.v_proj(x).view(b, t, -1, c.head_dim).transpose(1, 2)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        rep = c.num_attention_heads // c.num_key_value_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, heads, T, D]
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class Expert(nn.Module):
    def __init__(self, h: int, f: int):
        super().__init__()
        self.gate_proj = nn.Linear(h, f, bias=False)
        self.up_proj = nn.Linear(h, f, bias=False)
        self.down_proj = nn.Linear(f, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoe(nn.Module):
    """Softmax router over E, top-K, renormalized (norm_topk_prob), as Qwen3MoeSparseMoeBlock."""

    def __init__(self, c: DemoConfig):
        super().__init__()
        self.k = c.num_experts_per_tok
        self.gate = nn.Linear(c.hidden_size, c.num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(c.hidden_size, c.moe_intermediate_size) for _ in range(c.num_experts))

    def forward(self, x):                                            # x [N, H]
        probs = self.gate(x).float().softmax(-1)                     # [N, E]
        w, idx = probs.topk(self.k, dim=-1)                          # [N, K]
        w = (w / w.sum(-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows, slot = (idx == e).nonzero(as_tuple=True)
            if rows.numel():
                out.index_add_(0, rows, expert(x[rows]) * w[rows, slot, None])
        # Switch-style balance term: E * sum_e (share of routed slots to e) * (mean router prob of e)
        share = F.one_hot(idx, probs.shape[-1]).float().sum((0, 1)) / idx.numel()
        return out, probs.shape[-1] * (share * probs.mean(0)).sum(), idx


class Layer(nn.Module):
    def __init__(self, c: DemoConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = SparseMoe(c)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        y, aux, idx = self.mlp(self.post_attention_layernorm(x).reshape(-1, x.shape[-1]))
        return x + y.view_as(x), aux, idx


class Inner(nn.Module):
    def __init__(self, c: DemoConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class DemoMoe(nn.Module):
    """forward(ids [B, T]) -> (logits [B, T, V], mean balance loss, per-layer expert ids [N, K])."""

    def __init__(self, c: DemoConfig):
        super().__init__()
        self.c = c
        self.model = Inner(c)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2).float() / c.head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)
        for layer in self.model.layers:      # GPT-2's residual scaling keeps early steps stable
            nn.init.normal_(layer.self_attn.o_proj.weight, std=0.02 / (2 * c.num_hidden_layers) ** 0.5)
            for e in layer.mlp.experts:
                nn.init.normal_(e.down_proj.weight, std=0.02 / (2 * c.num_hidden_layers) ** 0.5)

    def forward(self, ids):
        t = ids.shape[1]
        freqs = torch.outer(torch.arange(t, dtype=torch.float32), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)                      # [T, D]
        cos, sin = emb.cos(), emb.sin()
        x = self.model.embed_tokens(ids)
        aux, routes = 0.0, []
        for layer in self.model.layers:
            x, a, idx = layer(x, cos, sin)
            aux, routes = aux + a, routes + [idx]
        return self.lm_head(self.model.norm(x)), aux / len(self.model.layers), routes
