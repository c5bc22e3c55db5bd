"""Qwen3.5 / 3.6 MoE (HF `qwen3_5_moe`, GGUF `qwen35moe`): a hybrid stack where most layers mix
tokens with a gated delta-net (models/deltanet.py, fixed recurrent state) and every n-th layer
runs full attention whose q projection also yields a per-channel output gate
(out * sigmoid(gate)), with per-head q/k RMSNorm and RoPE on the first rope_dim dims only.
Every layer's FFN is routed experts (softmax, renormalized top-k) plus a shared expert scaled by
a sigmoid gate. HF RMSNorm weights are zero-centred (x * (1 + w)); llama.cpp's converter stores
1 + w, so config.extra["norm_offset"] says which (the delta-net's gated norm is plain in both).

The MTP block (llama.cpp's layer n_layers, kept as common tensors) drafts tokens ahead for
`--speculative mtp`: `mtp_step` is one step (see its docstring), models/mtp.py chains them.

Legend: T tokens in the chunk, C hidden, H heads, G kv heads, D head dim, V vocab, k experts per token.
"""
from __future__ import annotations

import torch

from mawforge.models.kv import KVCache
from mawforge.kernels import linear
from mawforge.models.base import MoETransformer, attend, rms_norm, rope_rotate, route_softmax_topk
from mawforge.models.deltanet import DeltaNetMixer
from mawforge.models.mtp import MtpMixin


class Qwen35Moe(MtpMixin, MoETransformer, arch="qwen35moe"):
    def __init__(self, cfg, weights, experts, device):
        super().__init__(cfg, weights, experts, device)
        x = cfg.extra
        self.full = [t == "full" for t in x["layer_types"]]
        self.offset = float(x.get("norm_offset", 0.0))
        rd = int(x["rope_dim"])
        self.inv_freq = (1.0 / cfg.rope_base ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd)).to(device)
        self.mixer = DeltaNetMixer(weights, x["linear"], cfg.norm_eps)
        self._norms: dict[str, torch.Tensor] = {}

    def norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        if name not in self._norms:
            self._norms[name] = self.w.dense(name) + self.offset
        return rms_norm(x, self._norms[name], self.cfg.norm_eps)

    def beside_experts(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """The shared expert times sigmoid(h . w_gate); the gate is [1, C] in HF, [C] in GGUF."""
        p = f"blk.{layer}."
        g = linear(h, self.w.packed(p + "ffn_gate_shexp.weight")).float()           # [T, F_sh]
        u = linear(h, self.w.packed(p + "ffn_up_shexp.weight")).float()
        y = linear(torch.nn.functional.silu(g) * u, self.w.packed(p + "ffn_down_shexp.weight")).float()
        return torch.sigmoid(h @ self.w.dense(p + "ffn_gate_inp_shexp.weight").reshape(-1, 1)) * y

    def attention(self, layer: int, x: torch.Tensor, pos: torch.Tensor, kv) -> torch.Tensor:
        cfg, T, p = self.cfg, x.shape[0], f"blk.{layer}."
        H, G, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        qg = linear(x, self.w.packed(p + "attn_q.weight")).float().view(T, H, 2 * D)
        q, gate = qg[..., :D], qg[..., D:].reshape(T, H * D)
        k = linear(x, self.w.packed(p + "attn_k.weight")).float().view(T, G, D)
        v = linear(x, self.w.packed(p + "attn_v.weight")).float().view(T, G, D)
        q = rope_rotate(self.norm(q, p + "attn_q_norm.weight"), pos, self.inv_freq)
        k = rope_rotate(self.norm(k, p + "attn_k_norm.weight"), pos, self.inv_freq)
        keys, vals = kv.append(layer, k, v)                                       # [G, S, D]
        out = attend(q, keys, vals, D ** -0.5) * torch.sigmoid(gate)               # [T, H*D]
        return linear(out, self.w.packed(p + "attn_output.weight")).float()

    def layer(self, layer: int, h: torch.Tensor, pos: torch.Tensor, kv) -> torch.Tensor:
        p = f"blk.{layer}."
        x = self.norm(h, p + "attn_norm.weight")
        mix = (self.attention(layer, x, pos, kv) if self.full[layer]
               else self.mixer(layer, x, kv.layer_state(layer), kv.recorder(layer)))
        h = h + mix
        x = self.norm(h, p + "post_attention_norm.weight")
        if self.router_hook is not None:
            self.router_hook(layer, x)
        return h + self.ffn(layer, x)

    def hidden(self, tokens: torch.Tensor, pos0: int, kv) -> torch.Tensor:
        """tokens [T] -> final-normed hidden states [T, C] (the LM head's and the MTP's input)."""
        pos = torch.arange(pos0, pos0 + tokens.shape[0], device=self.device)
        h = self.w.embed(tokens)
        for layer in range(self.cfg.n_layers):
            h = self.layer(layer, h, pos, kv)
        return self.norm(h, "output_norm.weight")

    def _forward(self, tokens: torch.Tensor, pos0: int, kv, all_logits: bool = False) -> torch.Tensor:
        h = self.hidden(tokens, pos0, kv)
        self.keep_hidden(pos0, h)
        return linear(h if all_logits else h[-1:], self.w.head()).float()          # [T, V]

    # ---- multi-token prediction ---------------------------------------------------------
    def mtp_cache(self, context: int, dtype: torch.dtype = torch.float32) -> KVCache:
        """The MTP block's own one-layer KV cache (its layer index is n_layers)."""
        c = self.cfg
        layout = [{"kind": "none"}] * c.n_layers + [{"kind": "kv", "kv_heads": c.n_kv_heads, "head_dim": c.head_dim}]
        return KVCache(c.n_layers + 1, c.n_kv_heads, c.head_dim, context, dtype, self.device, layout)

    def mtp_step(self, hidden: torch.Tensor, tokens: torch.Tensor, pos0: int,
                 mtp_kv: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, C] at positions pos0.. (`hidden()`, or a previous step's output), tokens [T]
        at pos0+1.. -> (the block's normed output [T, C], draft logits [T, V] for pos0+2..).
        As llama.cpp's qwen35moe MTP graph: eh_proj(cat(enorm(embed(tok)), hnorm(hidden))), one
        full-attention MoE block at positions pos0.., shared_head_norm, LM head. The normed output
        is what the next chained step reads (as vLLM's Qwen3-Next MTP). The caller commits mtp_kv."""
        L, p = self.cfg.n_layers, f"blk.{self.cfg.n_layers}."
        e = self.norm(self.w.embed(tokens), p + "nextn.enorm.weight")
        hh = self.norm(hidden, p + "nextn.hnorm.weight")
        h = linear(torch.cat((e, hh), dim=-1), self.w.packed(p + "nextn.eh_proj.weight")).float()
        pos = torch.arange(pos0, pos0 + tokens.shape[0], device=self.device)
        h = h + self.attention(L, self.norm(h, p + "attn_norm.weight"), pos, mtp_kv)
        x = self.norm(h, p + "post_attention_norm.weight")
        logits = x @ self.w.dense(p + "ffn_gate_inp.weight").T
        idx, wts = route_softmax_topk(logits, self.cfg.top_k, self.cfg.norm_topk_prob)
        h = h + self.mtp_experts(L, x, idx, wts) + self.beside_experts(L, x)
        norm = p + "nextn.shared_head_norm.weight"
        out = self.norm(h, norm if self.w.has(norm) else "output_norm.weight")
        return out, linear(out, self.w.head()).float()

    def mtp_logits(self, hidden: torch.Tensor, tokens: torch.Tensor, pos0: int, mtp_kv: KVCache) -> torch.Tensor:
        """Draft logits [T, V] of one MTP step (see mtp_step)."""
        return self.mtp_step(hidden, tokens, pos0, mtp_kv)[1]
