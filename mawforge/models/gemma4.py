"""Gemma 4 MoE (HF `gemma4` / `gemma4_text` with enable_moe_block, GGUF `gemma4`), e.g. 26B-A4B.

Per layer: sliding-window or global attention (config.extra["layer_types"]); q and k get per-head
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

import torch
import torch.nn.functional as F

from mawforge.kernels import linear
from mawforge.models.base import MoETransformer, attend, rms_norm, rope_rotate, route_softmax_topk


def gelu_expert(x: torch.Tensor, parts: dict) -> torch.Tensor:
    """One routed expert with a GELU-tanh gate (fused gate_up or separate gate/up)."""
    if "gate_up" in parts:
        g, u = linear(x, parts["gate_up"]).chunk(2, dim=-1)
    else:
        g, u = linear(x, parts["gate"]), linear(x, parts["up"])
    return linear(F.gelu(g.float(), approximate="tanh") * u.float(), parts["down"]).float()


def _unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class Gemma4(MoETransformer, arch="gemma4"):
    expert_fn = staticmethod(gelu_expert)

    def __init__(self, cfg, weights, experts, device):
        super().__init__(cfg, weights, experts, device)
        x = cfg.extra
        self.full = [t == "full" for t in x["layer_types"]]
        self.window = int(x["sliding_window"])
        g = x["full"]
        self.shape = {False: (cfg.n_kv_heads, cfg.head_dim), True: (g["kv_heads"], g["head_dim"])}
        self.softcap = x.get("final_logit_softcapping")
        ds, df, pairs = cfg.head_dim, g["head_dim"], int(g["rope_pairs"])
        inv_s = 1.0 / cfg.rope_base ** (torch.arange(0, ds, 2, dtype=torch.float32) / ds)
        inv_f = 1.0 / float(g["rope_base"]) ** (torch.arange(0, df, 2, dtype=torch.float32) / df)
        inv_f[pairs:] = 0.0
        if weights.has("rope_freqs.weight"):      # GGUF: per-pair divisors, huge where HF has 0
            inv_f = inv_f / weights.dense("rope_freqs.weight").reshape(-1).cpu()
        self.inv_freq = {False: inv_s.to(device), True: inv_f.to(device)}

    def norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return rms_norm(x, self.w.dense(name), self.cfg.norm_eps)

    def attention(self, layer: int, x: torch.Tensor, pos: torch.Tensor, kv) -> torch.Tensor:
        T, p, full = x.shape[0], f"blk.{layer}.", self.full[layer]
        G, D = self.shape[full]
        q = linear(x, self.w.packed(p + "attn_q.weight")).float().view(T, -1, D)
        k = linear(x, self.w.packed(p + "attn_k.weight")).float().view(T, G, D)
        v = linear(x, self.w.packed(p + "attn_v.weight")).float().view(T, G, D) if self.w.has(p + "attn_v.weight") else k
        inv = self.inv_freq[full]
        q = rope_rotate(self.norm(q, p + "attn_q_norm.weight"), pos, inv)
        k = rope_rotate(self.norm(k, p + "attn_k_norm.weight"), pos, inv)
        keys, vals = kv.append(layer, k, _unit_rms(v, self.cfg.norm_eps))           # [G, S, D]
        out = attend(q, keys, vals, 1.0, None if full else self.window)             # [T, H*D]
        return linear(out, self.w.packed(p + "attn_output.weight")).float()

    def route(self, layer: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h is the residual stream (the router normalizes it itself)."""
        p = f"blk.{layer}."
        r = _unit_rms(h, self.cfg.norm_eps) * self.w.dense(p + "ffn_gate_inp.scale") * self.cfg.hidden ** -0.5
        idx, wts = route_softmax_topk(r @ self.w.dense(p + "ffn_gate_inp.weight").T, self.cfg.top_k, True)
        return idx, wts * self.w.dense(p + "ffn_down_exps.scale")[idx]                # [T, k]

    def ffn(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        p = f"blk.{layer}."
        x = self.norm(h, p + "ffn_norm.weight")
        g = linear(x, self.w.packed(p + "ffn_gate.weight")).float()
        u = linear(x, self.w.packed(p + "ffn_up.weight")).float()
        y = linear(F.gelu(g, approximate="tanh") * u, self.w.packed(p + "ffn_down.weight")).float()
        if self.w.has(p + "ffn_gate_inp.weight"):
            idx, wts = self.route(layer, h)
            moe = self.experts(layer, self.norm(h, p + "pre_ffw_norm_2.weight"), idx, wts)
            y = self.norm(y, p + "post_ffw_norm_1.weight") + self.norm(moe, p + "post_ffw_norm_2.weight")
        return self.norm(y, p + "post_ffw_norm.weight")

    def _forward(self, tokens: torch.Tensor, pos0: int, kv, all_logits: bool = False) -> torch.Tensor:
        pos = torch.arange(pos0, pos0 + tokens.shape[0], device=self.device)
        h = self.w.embed(tokens) * torch.tensor(self.cfg.hidden ** 0.5)              # [T, C]
        for layer in range(self.cfg.n_layers):
            p = f"blk.{layer}."
            a = self.attention(layer, self.norm(h, p + "attn_norm.weight"), pos, kv)
            h = h + self.norm(a, p + "post_attention_norm.weight")
            if self.router_hook is not None:
                self.router_hook(layer, h)
            h = h + self.ffn(layer, h)
            if self.w.has(p + "layer_output_scale.weight"):
                h = h * self.w.dense(p + "layer_output_scale.weight")
        h = self.norm(h if all_logits else h[-1:], "output_norm.weight")
        logits = linear(h, self.w.head()).float()                                    # [T, V]
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
