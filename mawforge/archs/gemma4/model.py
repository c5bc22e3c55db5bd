"""gemma4's model class (torch): see mawforge/archs/gemma4/__init__.py for the facts."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from mawforge.kernels import linear
from mawforge.models.base import MoETransformer, attend, rope_rotate, route_softmax_topk


def gelu_expert(x: torch.Tensor, parts: dict) -> torch.Tensor:
    """One routed expert with a GELU-tanh gate (fused gate_up or separate gate/up)."""
    if "gate_up" in parts:
        g, u = linear(x, parts["gate_up"]).chunk(2, dim=-1)
    else:
        g, u = linear(x, parts["gate"]), linear(x, parts["up"])
    return linear(F.gelu(g.float(), approximate="tanh") * u.float(), parts["down"]).float()


def _unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class Gemma4(MoETransformer):
    expert_fn = staticmethod(gelu_expert)

    def __init__(self, cfg, weights, experts, device):
        super().__init__(cfg, weights, experts, device)
        x = cfg.args
        self.full = x.full_layers()         # else sliding-window
        self.window = int(x.sliding_window)
        g = x.full
        self.shape = {False: (cfg.n_kv_heads, cfg.head_dim), True: (g["kv_heads"], g["head_dim"])}
        self.softcap = x.final_logit_softcapping
        ds, df, pairs = cfg.head_dim, g["head_dim"], int(g["rope_pairs"])
        inv_s = 1.0 / cfg.rope_base ** (torch.arange(0, ds, 2, dtype=torch.float32) / ds)
        inv_f = 1.0 / float(g["rope_base"]) ** (torch.arange(0, df, 2, dtype=torch.float32) / df)
        inv_f[pairs:] = 0.0
        if weights.has("rope_freqs.weight"):      # GGUF: per-pair divisors, huge where HF has 0
            inv_f = inv_f / weights.dense("rope_freqs.weight").reshape(-1).cpu()
        self.inv_freq = {False: inv_s.to(device), True: inv_f.to(device)}

    def attention(self, layer: int, x: torch.Tensor, pos: torch.Tensor, kv) -> torch.Tensor:
        T, full, lw = x.shape[0], self.full[layer], self.layers[layer]
        G, D = self.shape[full]
        q = linear(x, lw["attn_q.weight"]).float().view(T, -1, D)
        k = linear(x, lw["attn_k.weight"]).float().view(T, G, D)
        v = linear(x, lw["attn_v.weight"]).float().view(T, G, D) \
            if "attn_v.weight" in lw else k
        inv = self.inv_freq[full]
        q = rope_rotate(self.layer_norm(layer, q, "attn_q_norm.weight"), pos, inv)
        k = rope_rotate(self.layer_norm(layer, k, "attn_k_norm.weight"), pos, inv)
        keys, vals = kv.append(layer, k, _unit_rms(v, self.cfg.norm_eps))           # [G, S, D]
        out = attend(q, keys, vals, 1.0, None if full else self.window, kv.rotated)   # [T, H*D]
        return linear(out, lw["attn_output.weight"]).float()

    def route(self, layer: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h is the residual stream (the router normalizes it itself)."""
        lw = self.layers[layer]
        r = _unit_rms(h, self.cfg.norm_eps) * lw["ffn_gate_inp.scale"] * self.cfg.hidden ** -0.5
        idx, wts = route_softmax_topk(r @ lw["ffn_gate_inp.weight"].T, self.cfg.top_k, True)
        return idx, wts * lw["ffn_down_exps.scale"][idx]                # [T, k]

    def ffn(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        lw = self.layers[layer]
        x = self.layer_norm(layer, h, "ffn_norm.weight")
        g = linear(x, lw["ffn_gate.weight"]).float()
        u = linear(x, lw["ffn_up.weight"]).float()
        y = linear(F.gelu(g, approximate="tanh") * u, lw["ffn_down.weight"]).float()
        if "ffn_gate_inp.weight" in lw:
            idx, wts = self.route(layer, h)
            moe = self.experts(layer, self.layer_norm(layer, h, "pre_ffw_norm_2.weight"), idx, wts)
            y = (self.layer_norm(layer, y, "post_ffw_norm_1.weight")
                 + self.layer_norm(layer, moe, "post_ffw_norm_2.weight"))
        return self.layer_norm(layer, y, "post_ffw_norm.weight")

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.w.embed(tokens) * torch.tensor(self.cfg.hidden ** 0.5)          # [T, C]

    def mixer_out(self, layer: int, a: torch.Tensor) -> torch.Tensor:
        return self.layer_norm(layer, a, "post_attention_norm.weight")

    def ffn_input(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        return h                     # the FFN and the router normalize the residual stream themselves

    def layer_out(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        s = self.layers[layer].get("layer_output_scale.weight")
        return h if s is None else h * s

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        logits = linear(h, self.w.head()).float()                                    # [T, V]
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
