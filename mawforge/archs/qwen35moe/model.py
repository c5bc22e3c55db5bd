"""qwen35moe's model class (torch): see mawforge/archs/qwen35moe/__init__.py for the facts."""
from __future__ import annotations

import torch

from mawforge.kernels import linear
from mawforge.models.base import MoETransformer, attend, rope_inv_freq, rope_rotate, route_softmax_topk
from mawforge.models.deltanet import DeltaNetMixer
from mawforge.models.kv import KVCache
from mawforge.models.mtp import MtpMixin


class Qwen35Moe(MtpMixin, MoETransformer):
    ffn_norm_name = "post_attention_norm.weight"

    def __init__(self, cfg, weights, experts, device):
        super().__init__(cfg, weights, experts, device)
        x = cfg.args
        self.full = x.full_layers()        # else a delta-net layer
        self.inv_freq = rope_inv_freq(cfg.rope_base, x.rope_dim, device)     # partial rotary
        self.mixer_linear = DeltaNetMixer(self.layers, x.linear, cfg.norm_eps)

    def norm_weight(self, w: torch.Tensor) -> torch.Tensor:
        """1 + w for HF's zero-centred norms (Args.norm_offset 1), w + 0 for GGUF's: made once at load."""
        return w + float(self.cfg.args.norm_offset)

    def beside_experts(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """The shared expert times sigmoid(h . w_gate); the gate is [1, C] in HF, [C] in GGUF."""
        lw = self.layers[layer]
        g = linear(h, lw["ffn_gate_shexp.weight"]).float()           # [T, F_sh]
        u = linear(h, lw["ffn_up_shexp.weight"]).float()
        y = linear(torch.nn.functional.silu(g) * u, lw["ffn_down_shexp.weight"]).float()
        return torch.sigmoid(h @ lw["ffn_gate_inp_shexp.weight"].reshape(-1, 1)) * y

    def attention(self, layer: int, x: torch.Tensor, pos: torch.Tensor, kv) -> torch.Tensor:
        cfg, T, lw = self.cfg, x.shape[0], self.layers[layer]
        H, G, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        qg = linear(x, lw["attn_q.weight"]).float().view(T, H, 2 * D)
        q, gate = qg[..., :D], qg[..., D:].reshape(T, H * D)
        k = linear(x, lw["attn_k.weight"]).float().view(T, G, D)
        v = linear(x, lw["attn_v.weight"]).float().view(T, G, D)
        q = rope_rotate(self.layer_norm(layer, q, "attn_q_norm.weight"), pos, self.inv_freq)
        k = rope_rotate(self.layer_norm(layer, k, "attn_k_norm.weight"), pos, self.inv_freq)
        keys, vals = kv.append(layer, k, v)                                       # [G, S, D]
        out = attend(q, keys, vals, D ** -0.5) * torch.sigmoid(gate)               # [T, H*D]
        return linear(out, lw["attn_output.weight"]).float()

    def mixer(self, layer: int, x: torch.Tensor, pos: torch.Tensor, kv) -> torch.Tensor:
        if self.full[layer]:
            return self.attention(layer, x, pos, kv)
        return self.mixer_linear(layer, x, kv.layer_state(layer), kv.recorder(layer))

    # ---- multi-token prediction ---------------------------------------------------------
    def mtp_step(self, hidden: torch.Tensor, tokens: torch.Tensor, pos0: int,
                 mtp_kv: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, C] at positions pos0.. (`hidden()`, or a previous step's output), tokens [T]
        at pos0+1.. -> (the block's normed output [T, C], draft logits [T, V] for pos0+2..).
        As llama.cpp's qwen35moe MTP graph: eh_proj(cat(enorm(embed(tok)), hnorm(hidden))), one
        full-attention MoE block at positions pos0.., shared_head_norm, LM head. The normed output
        is what the next chained step reads (as vLLM's Qwen3-Next MTP). The caller commits mtp_kv."""
        L = self.cfg.n_layers
        lw = self.layers[L]
        e = self.layer_norm(L, self.w.embed(tokens), "nextn.enorm.weight")
        hh = self.layer_norm(L, hidden, "nextn.hnorm.weight")
        h = linear(torch.cat((e, hh), dim=-1), lw["nextn.eh_proj.weight"]).float()
        pos = torch.arange(pos0, pos0 + tokens.shape[0], device=self.device)
        h = h + self.attention(L, self.layer_norm(L, h, "attn_norm.weight"), pos, mtp_kv)
        x = self.layer_norm(L, h, "post_attention_norm.weight")
        logits = x @ lw["ffn_gate_inp.weight"].T
        idx, wts = route_softmax_topk(logits, self.cfg.top_k, self.cfg.norm_topk_prob)
        h = h + self.mtp_experts(L, x, idx, wts) + self.beside_experts(L, x)
        norm = "nextn.shared_head_norm.weight"
        out = self.norm(h, self.norms[L].get(norm, self.output_norm))
        return out, linear(out, self.w.head()).float()

    def mtp_logits(self, hidden: torch.Tensor, tokens: torch.Tensor, pos0: int, mtp_kv: KVCache) -> torch.Tensor:
        """Draft logits [T, V] of one MTP step (see mtp_step)."""
        return self.mtp_step(hidden, tokens, pos0, mtp_kv)[1]
