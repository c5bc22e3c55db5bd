"""glm4moe's model class (torch): see mawforge/archs/glm4moe/__init__.py for the facts."""
from __future__ import annotations

import torch

from mawforge.kernels import linear
from mawforge.models.base import MoETransformer, attend, rope_inv_freq, rope_rotate
from mawforge.models.kv import KVCache
from mawforge.models.mtp import MtpMixin


class Glm4Moe(MtpMixin, MoETransformer):
    def __init__(self, cfg, weights, experts, device):
        super().__init__(cfg, weights, experts, device)
        self.router, self.dense_layers = cfg.args.router, set(cfg.args.dense_layers)
        self.inv_freq = rope_inv_freq(cfg.rope_base, cfg.args.rope_dim, device)     # partial rotary

    ffn_norm_name = "post_attention_norm.weight"      # llama.cpp's name for the FFN input norm

    # ---- attention -------------------------------------------------------------------
    def qk_norm(self, layer: int, q: torch.Tensor, k: torch.Tensor):
        if "attn_q_norm.weight" not in self.layers[layer]:
            return q, k
        return self.layer_norm(layer, q, "attn_q_norm.weight"), self.layer_norm(layer, k, "attn_k_norm.weight")

    def attention(self, layer: int, x: torch.Tensor, pos: torch.Tensor, kv) -> torch.Tensor:
        cfg, T, lw = self.cfg, x.shape[0], self.layers[layer]
        H, G, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        q = lw.proj("attn_q.weight", x).float().view(T, H, D)
        k = lw.proj("attn_k.weight", x).float().view(T, G, D)
        v = lw.proj("attn_v.weight", x).float().view(T, G, D)
        q, k = self.qk_norm(layer, q, k)                                      # per head, before RoPE
        q, k = rope_rotate(q, pos, self.inv_freq), rope_rotate(k, pos, self.inv_freq)   # first R dims
        keys, vals = kv.append(layer, k, v)                                   # [G, S, D]
        return lw.proj("attn_output.weight", attend(q, keys, vals, self.scale))

    # ---- feed-forward ----------------------------------------------------------------
    def mlp(self, layer: int, suffix: str, x: torch.Tensor) -> torch.Tensor:
        """Dense SwiGLU from blk.N.ffn_{gate,up,down}{suffix}.weight. x [T, C] -> [T, C]."""
        lw = self.layers[layer]
        g = linear(x, lw[f"ffn_gate{suffix}.weight"]).float()
        u = linear(x, lw[f"ffn_up{suffix}.weight"]).float()
        return linear(torch.nn.functional.silu(g) * u, lw[f"ffn_down{suffix}.weight"]).float()

    def route(self, layer: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        T, lw, r = h.shape[0], self.layers[layer], self.router
        if layer in self.dense_layers:       # no router (lookahead may still ask)
            return torch.zeros(T, 0, dtype=torch.long, device=h.device), torch.zeros(T, 0, device=h.device)
        scores = (h.float() @ lw["ffn_gate_inp.weight"].T).sigmoid()      # [T, E]
        choice = scores + lw["exp_probs_b.bias"]                # bias: the choice only
        if r["groups_used"] < r["groups"]:   # keep the groups whose two best experts sum highest
            best2 = choice.view(T, r["groups"], -1).topk(2, dim=-1).values.sum(-1)        # [T, groups]
            drop = torch.ones_like(best2, dtype=torch.bool).scatter_(
                1, best2.topk(r["groups_used"], dim=-1).indices, False)
            choice = choice.masked_fill(drop.repeat_interleave(choice.shape[1] // r["groups"], dim=1),
                                        float("-inf"))
        idx = choice.topk(self.cfg.top_k, dim=-1).indices                     # [T, k]
        w = scores.gather(1, idx)
        w = w / (w.sum(-1, keepdim=True) + 1e-20) if self.cfg.norm_topk_prob else w
        return idx, w * r["scale"]

    def ffn(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        if layer in self.dense_layers:
            return self.mlp(layer, "", x)
        return super().ffn(layer, x)

    def beside_experts(self, layer: int, h: torch.Tensor) -> torch.Tensor | None:
        return self.mlp(layer, "_shexp", h) if "ffn_gate_shexp.weight" in self.layers[layer] else None

    # ---- multi-token prediction ------------------------------------------------------
    def mtp_step(self, hidden: torch.Tensor, tokens: torch.Tensor, pos0: int,
                 mtp_kv: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, C] at positions pos0.. (`hidden()`, or a previous step's output), tokens [T]
        at pos0+1.. -> (the layer's normed output [T, C], draft logits [T, V] for pos0+2..). As
        llama.cpp's glm4moe MTP graph: eh_proj(cat(enorm(embed(tok)), hnorm(hidden))), one decoder
        layer (attention, MoE with the shared expert), shared_head_norm, the model's LM head; the
        normed output (llama.cpp's h_nextn) is what the next chained step reads. The caller
        commits mtp_kv."""
        L = self.cfg.n_layers
        e = self.layer_norm(L, self.embed(tokens), "nextn.enorm.weight")
        hh = self.layer_norm(L, hidden, "nextn.hnorm.weight")
        h = self.layers[L].proj("nextn.eh_proj.weight", torch.cat((e, hh), dim=-1)).float()
        pos = torch.arange(pos0, pos0 + tokens.shape[0], device=self.device)
        h = h + self.attention(L, self.layer_norm(L, h, "attn_norm.weight"), pos, mtp_kv)
        x = self.ffn_input(L, h)
        idx, wts = self.route(L, x)
        h = h + self.mtp_experts(L, x, idx, wts) + self.beside_experts(L, x)
        norm = "nextn.shared_head_norm.weight"
        out = self.norm(h, self.norms[L].get(norm, self.output_norm))
        return out, self.logits(out)
