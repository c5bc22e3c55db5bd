"""GLM-4.5 / 4.6 MoE (HF `glm4_moe`, GGUF `glm4moe`).

Grouped-query attention with q/k/v biases, optional per-head q/k RMSNorm (GLM-4.5 and 4.6 have
it, the Air does not) and NEOX RoPE on the first rope_dim = head_dim * partial_rotary_factor
(0.5) dims of each head only. The first first_k_dense_replace layers run a dense SwiGLU; the
others route as DeepSeek-V3: sigmoid scores, e_score_correction_bias added for the choice only,
the choice limited to the best groups (sum of each group's top-2), top-k of the kept experts,
weights renormalized and scaled by routed_scaling_factor; one shared expert runs beside them.
The FFN input norm is post_attention_layernorm (llama.cpp's post_attention_norm).

The released checkpoints keep one MTP (nextn) layer after the last layer (llama.cpp's layer
n_layers, packed as common tensors, its routed experts included); `mtp_step` is one step of it
for `--speculative mtp`, models/mtp.py chains them.

Legend: T tokens, C hidden, H heads, G kv heads, D head dim, R rope dims, V vocab, k experts per token.
"""
from __future__ import annotations

import torch

from mawforge.kernels import linear
from mawforge.models.base import MoETransformer, attend, rms_norm, rope_rotate
from mawforge.models.kv import KVCache
from mawforge.models.mtp import MtpMixin


class Glm4Moe(MtpMixin, MoETransformer, arch="glm4moe"):
    ffn_norm_name = "post_attention_norm.weight"

    def __init__(self, cfg, weights, experts, device):
        super().__init__(cfg, weights, experts, device)
        x = cfg.extra
        self.router, self.dense_layers = x["router"], set(x.get("dense_layers", ()))
        r = int(x["rope_dim"])
        self.inv_freq = (1.0 / cfg.rope_base ** (torch.arange(0, r, 2, dtype=torch.float32) / r)).to(device)  # [R/2]

    # ---- attention -----------------------------------------------------------------------
    def qk_norm(self, layer: int, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p, eps = f"blk.{layer}.", self.cfg.norm_eps
        if not self.w.has(p + "attn_q_norm.weight"):
            return q, k
        return (rms_norm(q, self.w.dense(p + "attn_q_norm.weight"), eps),
                rms_norm(k, self.w.dense(p + "attn_k_norm.weight"), eps))

    def attention(self, layer: int, x: torch.Tensor, pos: torch.Tensor, kv) -> torch.Tensor:
        cfg, T, p = self.cfg, x.shape[0], f"blk.{layer}."
        H, G, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        q = self.proj(p + "attn_q.weight", x).float().view(T, H, D)
        k = self.proj(p + "attn_k.weight", x).float().view(T, G, D)
        v = self.proj(p + "attn_v.weight", x).float().view(T, G, D)
        q, k = self.qk_norm(layer, q, k)                                          # per head, before RoPE
        q, k = rope_rotate(q, pos, self.inv_freq), rope_rotate(k, pos, self.inv_freq)
        keys, vals = kv.append(layer, k, v)                                       # [G, S, D]
        return self.proj(p + "attn_output.weight", attend(q, keys, vals, self.scale))

    # ---- feed-forward --------------------------------------------------------------------
    def _mlp(self, p: str, suffix: str, x: torch.Tensor) -> torch.Tensor:
        """Dense SwiGLU from blk.N.ffn_{gate,up,down}{suffix}.weight. x [T, C] -> [T, C]."""
        g = linear(x, self.w.packed(f"{p}ffn_gate{suffix}.weight")).float()
        u = linear(x, self.w.packed(f"{p}ffn_up{suffix}.weight")).float()
        return linear(torch.nn.functional.silu(g) * u, self.w.packed(f"{p}ffn_down{suffix}.weight")).float()

    def route(self, layer: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        T, k, p, r = h.shape[0], self.cfg.top_k, f"blk.{layer}.", self.router
        if layer in self.dense_layers:       # no router (lookahead may still ask)
            return torch.zeros(T, 0, dtype=torch.long, device=h.device), torch.zeros(T, 0, device=h.device)
        scores = (h.float() @ self.w.dense(p + "ffn_gate_inp.weight").T).sigmoid()  # [T, E]
        choice = scores + self.w.dense(p + "exp_probs_b.bias")
        if r["groups_used"] < r["groups"]:
            g = choice.view(T, r["groups"], -1)                                   # [T, groups, E/groups]
            keep = torch.zeros(T, r["groups"], dtype=torch.bool, device=h.device)
            keep.scatter_(1, g.topk(2, dim=-1).values.sum(-1).topk(r["groups_used"], dim=-1).indices, True)
            choice = choice.masked_fill(~keep.repeat_interleave(g.shape[-1], dim=1), float("-inf"))
        idx = choice.topk(k, dim=-1).indices                                      # [T, k]
        w = scores.gather(1, idx)
        if self.cfg.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return idx, w * r["scale"]

    def ffn(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        if layer in self.dense_layers:
            return self._mlp(f"blk.{layer}.", "", x)
        return super().ffn(layer, x)

    def beside_experts(self, layer: int, h: torch.Tensor) -> torch.Tensor | None:
        p = f"blk.{layer}."
        return self._mlp(p, "_shexp", h) if self.w.has(p + "ffn_gate_shexp.weight") else None

    # ---- multi-token prediction ---------------------------------------------------------
    def _forward(self, tokens: torch.Tensor, pos0: int, kv, all_logits: bool) -> torch.Tensor:
        if self.mtp is None:
            return super()._forward(tokens, pos0, kv, all_logits)
        h = self.hidden(tokens, pos0, kv)
        self.keep_hidden(pos0, h)
        return linear(h if all_logits else h[-1:], self.w.head()).float()          # [T, V]

    def mtp_cache(self, context: int, dtype: torch.dtype = torch.float32) -> KVCache:
        """The MTP layer's own one-layer KV cache (its layer index is n_layers)."""
        c = self.cfg
        layout = [{"kind": "none"}] * c.n_layers + [{"kind": "kv", "kv_heads": c.n_kv_heads, "head_dim": c.head_dim}]
        return KVCache(c.n_layers + 1, c.n_kv_heads, c.head_dim, context, dtype, self.device, layout)

    def mtp_step(self, hidden: torch.Tensor, tokens: torch.Tensor, pos0: int,
                 mtp_kv: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, C] at positions pos0.. (`hidden()`, or a previous step's output), tokens [T]
        at pos0+1.. -> (the layer's normed output [T, C], draft logits [T, V] for pos0+2..). As
        llama.cpp's glm4moe MTP graph: eh_proj(cat(enorm(embed(tok)), hnorm(hidden))), one decoder
        layer (attention, MoE with the shared expert), shared_head_norm, the model's LM head; the
        normed output (llama.cpp's h_nextn) is what the next chained step reads. The caller
        commits mtp_kv."""
        L, eps = self.cfg.n_layers, self.cfg.norm_eps
        p = f"blk.{L}."
        e = rms_norm(self.w.embed(tokens), self.w.dense(p + "nextn.enorm.weight"), eps)
        hh = rms_norm(hidden, self.w.dense(p + "nextn.hnorm.weight"), eps)
        h = self.proj(p + "nextn.eh_proj.weight", torch.cat((e, hh), dim=-1)).float()
        pos = torch.arange(pos0, pos0 + tokens.shape[0], device=self.device)
        h = h + self.attention(L, rms_norm(h, self.w.dense(p + "attn_norm.weight"), eps), pos, mtp_kv)
        x = rms_norm(h, self.w.dense(p + self.ffn_norm_name), eps)
        idx, wts = self.route(L, x)
        h = h + self.mtp_experts(L, x, idx, wts) + self.beside_experts(L, x)
        norm = p + "nextn.shared_head_norm.weight"
        out = rms_norm(h, self.w.dense(norm if self.w.has(norm) else "output_norm.weight"), eps)
        return out, linear(out, self.w.head()).float()
