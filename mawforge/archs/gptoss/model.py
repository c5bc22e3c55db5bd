"""gptoss's model class (torch): see mawforge/archs/gptoss/__init__.py for the facts."""
from __future__ import annotations

import functools

import torch

from mawforge.codecs import quants
from mawforge.kernels import linear, q8_0
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


class GptOss(MoETransformer):
    ffn_norm_name = "post_attention_norm.weight"

    def __init__(self, cfg, weights, experts, device):
        super().__init__(cfg, weights, experts, device)
        x = cfg.args
        self.rope = Rope(cfg.head_dim, cfg.rope_base, "neox", device, x.rope_scaling)
        self.windows = [x.sliding_window if t == "sliding" else None for t in x.layer_types]
        self.expert_fn = functools.partial(oss_expert, alpha=x.swiglu_alpha, limit=x.swiglu_limit)

    def route(self, layer: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lw = self.layers[layer]
        logits = h.float() @ lw["ffn_gate_inp.weight"].T + lw["ffn_gate_inp.bias"]
        top, idx = torch.topk(logits, self.cfg.top_k, dim=-1)                     # [T, k]
        return idx, torch.softmax(top, dim=-1)

    def router_logits(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        lw = self.layers[layer]
        return h.float() @ lw["ffn_gate_inp.weight"].T + lw["ffn_gate_inp.bias"]

    def attention(self, layer: int, x: torch.Tensor, pos: torch.Tensor, kv) -> torch.Tensor:
        cfg, T, lw = self.cfg, x.shape[0], self.layers[layer]
        H, G, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        q = self.rope(lw.proj("attn_q.weight", x).float().view(T, H, D), pos)
        k = self.rope(lw.proj("attn_k.weight", x).float().view(T, G, D), pos)
        v = lw.proj("attn_v.weight", x).float().view(T, G, D)
        keys, vals = kv.append(layer, k, v)                                       # [G, S, D]
        S = keys.shape[1]
        qg = q.view(T, G, H // G, D).permute(1, 2, 0, 3).reshape(G, H // G * T, D)
        if keys.dtype == torch.uint8:       # a q8_0 cache: q rotated and through q8_0 (models/base.attend)
            qg = q8_0.query(qg, kv.rotated)
        scores = torch.bmm(qg, q8_0.rows_float(keys).transpose(1, 2)).view(G, H // G, T, S) * self.scale
        qpos = S - T + torch.arange(T, device=x.device)[:, None]                  # [T, 1]
        kpos = torch.arange(S, device=x.device)[None]                             # [1, S]
        mask = kpos > qpos
        if self.windows[layer] is not None:
            mask = mask | (kpos <= qpos - self.windows[layer])
        scores = scores.masked_fill(mask, float("-inf"))
        sink = lw["attn_sinks.weight"].view(G, H // G, 1, 1).expand(G, H // G, T, 1)
        probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :S]  # [G, H/G, T, S]
        out = torch.bmm(probs.reshape(G, H // G * T, S), q8_0.rows_float(vals))   # [G, H/G*T, D]
        if keys.dtype == torch.uint8:
            out = q8_0.output(out, kv.rotated)
        out = out.view(G, H // G, T, D).permute(2, 0, 1, 3).reshape(T, H * D)
        return lw.proj("attn_output.weight", out)
