"""qwen35moe's model class (torch): see mawforge/archs/qwen35moe/__init__.py for the facts."""
from __future__ import annotations

import torch

from mawforge.kernels import linear
from mawforge.models.base import MoETransformer, attend, rope_inv_freq, rms_norm, rope_rotate, route_softmax_topk
from mawforge.models.deltanet import DeltaNetMixer
from mawforge.models.kv import KVCache
from mawforge.models.mtp import MtpMixin


class Qwen35Moe(MtpMixin, MoETransformer):
    ffn_norm_name = "post_attention_norm.weight"

    def __init__(self, cfg, weights, experts, device):
        super().__init__(cfg, weights, experts, device)
        x = cfg.args
        self.full = x.full_layers()        # else a delta-net layer
        self.offset = float(x.norm_offset)
        self.inv_freq = rope_inv_freq(cfg.rope_base, x.rope_dim, device)     # partial rotary
        self.mixer_linear = DeltaNetMixer(self.layers, x.linear, cfg.norm_eps)
        self._norms: dict[str, torch.Tensor] = {}

    def norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        if name not in self._norms:
            self._norms[name] = self.w.dense(name) + self.offset
        return rms_norm(x, self._norms[name], self.cfg.norm_eps)

    def beside_experts(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """The shared expert times sigmoid(h . w_gate); the gate is [1, C] in HF, [C] in GGUF."""
        lw = self.layers[layer]
        g = linear(h, lw["ffn_gate_shexp.weight"]).float()           # [T, F_sh]
        u = linear(h, lw["ffn_up_shexp.weight"]).float()
        y = linear(torch.nn.functional.silu(g) * u, lw["ffn_down_shexp.weight"]).float()
        return torch.sigmoid(h @ lw["ffn_gate_inp_shexp.weight"].reshape(-1, 1)) * y

    def attention(self, layer: int, x: torch.Tensor, pos: torch.Tensor, kv) -> torch.Tensor:
        cfg, T, p, lw = self.cfg, x.shape[0], f"blk.{layer}.", self.layers[layer]
        H, G, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        qg = linear(x, lw["attn_q.weight"]).float().view(T, H, 2 * D)
        q, gate = qg[..., :D], qg[..., D:].reshape(T, H * D)
        k = linear(x, lw["attn_k.weight"]).float().view(T, G, D)
        v = linear(x, lw["attn_v.weight"]).float().view(T, G, D)
        q = rope_rotate(self.norm(q, p + "attn_q_norm.weight"), pos, self.inv_freq)
        k = rope_rotate(self.norm(k, p + "attn_k_norm.weight"), pos, self.inv_freq)
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
        L, p = self.cfg.n_layers, f"blk.{self.cfg.n_layers}."
        lw = self.layers[L]
        e = self.norm(self.w.embed(tokens), p + "nextn.enorm.weight")
        hh = self.norm(hidden, p + "nextn.hnorm.weight")
        h = linear(torch.cat((e, hh), dim=-1), lw["nextn.eh_proj.weight"]).float()
        pos = torch.arange(pos0, pos0 + tokens.shape[0], device=self.device)
        h = h + self.attention(L, self.norm(h, p + "attn_norm.weight"), pos, mtp_kv)
        x = self.norm(h, p + "post_attention_norm.weight")
        logits = x @ lw["ffn_gate_inp.weight"].T
        idx, wts = route_softmax_topk(logits, self.cfg.top_k, self.cfg.norm_topk_prob)
        h = h + self.mtp_experts(L, x, idx, wts) + self.beside_experts(L, x)
        norm = "nextn.shared_head_norm.weight"
        out = self.norm(h, p + norm if norm in lw else "output_norm.weight")
        return out, linear(out, self.w.head()).float()

    def mtp_logits(self, hidden: torch.Tensor, tokens: torch.Tensor, pos0: int, mtp_kv: KVCache) -> torch.Tensor:
        """Draft logits [T, V] of one MTP step (see mtp_step)."""
        return self.mtp_step(hidden, tokens, pos0, mtp_kv)[1]
