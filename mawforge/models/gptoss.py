"""GPT-OSS (HF `gpt_oss`, GGUF `gpt-oss`).

Attention: GQA with q/k/v/o biases, NEOX RoPE (YaRN in the released models), a learned sink
logit per head that joins each softmax and is dropped after it, and every other layer (the
even ones) limited to a sliding window. The KV cache keeps the whole context for every layer
(the window is a mask), so the planner's K counts full-length KV for the sliding layers too.
Router: logits with bias, top-k, softmax over the k chosen logits.
Experts: clamped SwiGLU: g = min(g, limit), u = clamp(u, -limit, limit),
out = (u + 1) * g * sigmoid(alpha * g), with biases after gate/up and after down.

Expert layouts (an expert block holds its weights and its biases):
  GGUF (convert_hf_to_gguf): ffn_gate_exps / ffn_up_exps [E, F, H] and ffn_down_exps [E, H, F],
      usually MXFP4 (packed byte-exact in the `ggml` codec, dequantized per row tile by the
      gguf reference dequantizer, then a float matmul), plus F32 biases [E, F] / [E, H].
  HF (bf16/f32 checkpoints): gate_up_proj [E, H, 2F] input-major with gate and up interleaved
      in the columns (gate = even, up = odd), down_proj [E, F, H] input-major, biases
      gate_up_proj_bias [E, 2F] (interleaved the same way) and down_proj_bias [E, H]. Stored
      as the kinds gate_up_t / down_t and computed as x @ W. HF MXFP4 checkpoints
      (*_blocks / *_scales) are refused by the reader: convert them to GGUF.

Legend: T tokens, C hidden, H q heads, G kv heads, D head dim, S cached positions, F expert ff.
"""
from __future__ import annotations

import functools

import torch

from mawforge.formats import quants
from mawforge.kernels import linear
from mawforge.models.base import MoETransformer, Rope


def _vec(w) -> torch.Tensor:
    return quants.dequantize(w).reshape(-1)


def _matmul_t(x: torch.Tensor, w) -> torch.Tensor:
    """x [n, K] @ W where W is stored input-major [K, N] (HF GPT-OSS experts)."""
    return x.float() @ quants.dequantize(w)


def oss_expert(x: torch.Tensor, parts: dict, alpha: float, limit: float) -> torch.Tensor:
    """One GPT-OSS expert on its tokens. x [n, C] -> [n, C]."""
    if "gate_up_t" in parts:
        gu = _matmul_t(x, parts["gate_up_t"]) + _vec(parts["gate_up_bias"])     # [n, 2F]
        g, u = gu[:, 0::2], gu[:, 1::2]
    else:
        g = linear(x, parts["gate"]).float() + _vec(parts["gate_bias"])         # [n, F]
        u = linear(x, parts["up"]).float() + _vec(parts["up_bias"])
    g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    a = (u + 1) * g * torch.sigmoid(alpha * g)
    y = _matmul_t(a, parts["down_t"]) if "down_t" in parts else linear(a, parts["down"]).float()
    return y + _vec(parts["down_bias"])


class GptOss(MoETransformer, arch="gpt-oss"):
    ffn_norm_name = "post_attention_norm.weight"

    def __init__(self, cfg, weights, experts, device):
        super().__init__(cfg, weights, experts, device)
        x = cfg.extra
        self.rope = Rope(cfg.head_dim, cfg.rope_base, "neox", device, x.get("rope_scaling"))
        self.windows = [x["sliding_window"] if t == "sliding" else None for t in x["layer_types"]]
        self.expert_fn = functools.partial(oss_expert, alpha=x["swiglu_alpha"], limit=x["swiglu_limit"])

    def route(self, layer: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p = f"blk.{layer}."
        logits = h.float() @ self.w.dense(p + "ffn_gate_inp.weight").T + self.w.dense(p + "ffn_gate_inp.bias")
        top, idx = torch.topk(logits, self.cfg.top_k, dim=-1)                     # [T, k]
        return idx, torch.softmax(top, dim=-1)

    def attention(self, layer: int, x: torch.Tensor, pos: torch.Tensor, kv) -> torch.Tensor:
        cfg, T, p = self.cfg, x.shape[0], f"blk.{layer}."
        H, G, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        q = self.rope(self.proj(p + "attn_q.weight", x).float().view(T, H, D), pos)
        k = self.rope(self.proj(p + "attn_k.weight", x).float().view(T, G, D), pos)
        v = self.proj(p + "attn_v.weight", x).float().view(T, G, D)
        keys, vals = kv.append(layer, k, v)                                       # [G, S, D]
        S = keys.shape[1]
        qg = q.view(T, G, H // G, D).permute(1, 2, 0, 3).reshape(G, H // G * T, D)
        scores = torch.bmm(qg, keys.float().transpose(1, 2)).view(G, H // G, T, S) * self.scale
        qpos = S - T + torch.arange(T, device=x.device)[:, None]                  # [T, 1]
        kpos = torch.arange(S, device=x.device)[None]                             # [1, S]
        mask = kpos > qpos
        if self.windows[layer] is not None:
            mask = mask | (kpos <= qpos - self.windows[layer])
        scores = scores.masked_fill(mask, float("-inf"))
        sink = self.w.dense(p + "attn_sinks.weight").view(G, H // G, 1, 1).expand(G, H // G, T, 1)
        probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :S]  # [G, H/G, T, S]
        out = torch.bmm(probs.reshape(G, H // G * T, S), vals.float())             # [G, H/G*T, D]
        out = out.view(G, H // G, T, D).permute(2, 0, 1, 3).reshape(T, H * D)
        return self.proj(p + "attn_output.weight", out)
