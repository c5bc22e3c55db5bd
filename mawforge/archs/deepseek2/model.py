"""deepseek2's model class (torch): see mawforge/archs/deepseek2/__init__.py for the facts."""
from __future__ import annotations

import torch

from mawforge.archs._yarn import yarn_mscale
from mawforge.kernels import linear, q8_0
from mawforge.models.base import MoETransformer, Rope, rms_norm
from mawforge.models.kv import KVCache
from mawforge.models.mtp import MtpMixin


def swiglu_mlp(lw: dict, suffix: str, x: torch.Tensor) -> torch.Tensor:
    """Dense SwiGLU from one layer's bound ffn_{gate,up,down}{suffix}.weight. x [T, C] -> [T, C]."""
    g = linear(x, lw[f"ffn_gate{suffix}.weight"]).float()
    u = linear(x, lw[f"ffn_up{suffix}.weight"]).float()
    return linear(torch.nn.functional.silu(g) * u, lw[f"ffn_down{suffix}.weight"]).float()


class Deepseek2(MtpMixin, MoETransformer):
    def __init__(self, cfg, weights, experts, device):
        super().__init__(cfg, weights, experts, device)
        x = cfg.args
        self.mla, self.router, self.dense_layers = x.mla, x.router, set(x.dense_layers)
        m, yarn = self.mla, x.rope_scaling
        self.rope = Rope(m["qk_rope"], cfg.rope_base, "norm", device, yarn)
        self.scale = (m["qk_nope"] + m["qk_rope"]) ** -0.5
        if yarn and yarn.get("mscale_all_dim"):
            self.scale *= yarn_mscale(yarn["factor"], yarn["mscale_all_dim"]) ** 2

    # ---- attention -----------------------------------------------------------------------
    def _up(self, lw: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """W_uk [H, N, R] and W_uv [H, Vd, R] of one layer (its bound tensors)."""
        H, N, Vd, R = self.cfg.n_heads, self.mla["qk_nope"], self.mla["v_head_dim"], self.mla["kv_lora_rank"]
        if "attn_k_b.weight" in lw:
            return (lw["attn_k_b.weight"].reshape(H, R, N).transpose(1, 2),
                    lw["attn_v_b.weight"].reshape(H, Vd, R))
        kvb = lw["attn_kv_b.weight"].reshape(H, N + Vd, R)
        return kvb[:, :N], kvb[:, N:]

    def _query(self, lw: dict, x: torch.Tensor) -> torch.Tensor:
        if not self.mla["q_lora_rank"]:
            return lw.proj("attn_q.weight", x).float()
        qa = rms_norm(lw.proj("attn_q_a.weight", x).float(), lw["attn_q_a_norm.weight"],
                      self.cfg.norm_eps)
        return lw.proj("attn_q_b.weight", qa).float()                       # [T, H*(N+P)]

    def attention(self, layer: int, x: torch.Tensor, pos: torch.Tensor, kv) -> torch.Tensor:
        T, H, lw = x.shape[0], self.cfg.n_heads, self.layers[layer]
        N, R = self.mla["qk_nope"], self.mla["kv_lora_rank"]
        q = self._query(lw, x).view(T, H, -1)
        q_nope, q_pe = q[..., :N], self.rope(q[..., N:], pos)                     # [T, H, N], [T, H, P]
        ckv = lw.proj("attn_kv_a_mqa.weight", x).float()                    # [T, R+P]
        c = rms_norm(ckv[:, :R], lw["attn_kv_a_norm.weight"], self.cfg.norm_eps)
        k_pe = self.rope(ckv[:, None, R:], pos)[:, 0]                             # [T, P]
        lat = q8_0.rows_float(kv.append_latent(layer, torch.cat((c, k_pe), dim=-1)))       # [S, R+P]
        S = lat.shape[0]
        w_uk, w_uv = self._up(lw)
        q_abs = torch.einsum("thn,hnr->htr", q_nope, w_uk)                        # [H, T, R]
        scores = (q_abs @ lat[:, :R].T + q_pe.transpose(0, 1) @ lat[:, R:].T) * self.scale   # [H, T, S]
        mask = torch.arange(S, device=x.device)[None] > (S - T + torch.arange(T, device=x.device))[:, None]
        probs = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
        o_lat = probs @ lat[:, :R]                                                # [H, T, R]
        out = torch.einsum("htr,hvr->thv", o_lat, w_uv).reshape(T, -1)            # [T, H*Vd]
        return lw.proj("attn_output.weight", out)

    # ---- feed-forward --------------------------------------------------------------------
    def route(self, layer: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        T, k, lw, r = h.shape[0], self.cfg.top_k, self.layers[layer], self.router
        if layer in self.dense_layers:       # no router (lookahead may still ask)
            return (torch.zeros(T, 0, dtype=torch.long, device=h.device),
                    torch.zeros(T, 0, device=h.device))
        logits = h.float() @ lw["ffn_gate_inp.weight"].T            # [T, E]
        scores = logits.sigmoid() if r["gating"] == "sigmoid" else logits.softmax(dim=-1)
        choice = scores + lw["exp_probs_b.bias"] if "exp_probs_b.bias" in lw else scores
        if r["groups_used"] < r["groups"]:
            g = choice.view(T, r["groups"], -1)                                   # [T, G, E/G]
            gs = g.topk(2, dim=-1).values.sum(-1) if r["group_score"] == "top2sum" else g.amax(-1)
            keep = torch.zeros_like(gs, dtype=torch.bool).scatter_(
                1, gs.topk(r["groups_used"], dim=-1).indices, True)
            choice = choice.masked_fill(~keep.repeat_interleave(g.shape[-1], dim=1), float("-inf"))
        idx = choice.topk(k, dim=-1).indices                                      # [T, k]
        w = scores.gather(1, idx)
        if self.cfg.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return idx, w * r["scale"]

    def ffn(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        if layer in self.dense_layers:
            return swiglu_mlp(self.layers[layer], "", x)
        return super().ffn(layer, x)

    def beside_experts(self, layer: int, h: torch.Tensor) -> torch.Tensor | None:
        lw = self.layers[layer]
        return swiglu_mlp(lw, "_shexp", h) if "ffn_gate_shexp.weight" in lw else None

    # ---- multi-token prediction ---------------------------------------------------------
    def mtp_cache(self, context: int, dtype: torch.dtype = torch.float32) -> KVCache:
        """The MTP layer's own compressed KV cache (its layer index is n_layers)."""
        c, m = self.cfg, self.mla
        layout = [{"kind": "none"}] * c.n_layers + [{"kind": "latent", "dim": m["kv_lora_rank"] + m["qk_rope"]}]
        return KVCache(c.n_layers + 1, c.n_kv_heads, c.head_dim, context, dtype, self.device, layout)

    def mtp_step(self, hidden: torch.Tensor, tokens: torch.Tensor, pos0: int,
                 mtp_kv: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, C] at positions pos0.. (`hidden()`, or a previous step's output), tokens [T]
        at pos0+1.. -> (the layer's output [T, C], draft logits [T, V] for pos0+2..). DeepSeek-V3
        MTP: eh_proj(cat(enorm(embed(tok)), hnorm(hidden))), one decoder layer (MLA + MoE with
        shared experts), shared_head.norm, the shared LM head. The next chained step reads the
        un-normed output (as vLLM's DeepSeek MTP). The caller commits mtp_kv."""
        L, eps = self.cfg.n_layers, self.cfg.norm_eps
        lw = self.layers[L]
        e = rms_norm(self.w.embed(tokens), lw["nextn.enorm.weight"], eps)
        hh = rms_norm(hidden, lw["nextn.hnorm.weight"], eps)
        h = lw.proj("nextn.eh_proj.weight", torch.cat((e, hh), dim=-1)).float()
        pos = torch.arange(pos0, pos0 + tokens.shape[0], device=self.device)
        h = h + self.attention(L, rms_norm(h, lw["attn_norm.weight"], eps), pos, mtp_kv)
        x = rms_norm(h, lw[self.ffn_norm_name], eps)
        idx, wts = self.route(L, x)
        h = h + self.mtp_experts(L, x, idx, wts)
        shared = self.beside_experts(L, x)
        h = h if shared is None else h + shared
        out = rms_norm(h, lw["nextn.shared_head_norm.weight"], eps)
        return h, linear(out, self.w.head()).float()
