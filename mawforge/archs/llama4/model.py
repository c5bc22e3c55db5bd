"""llama4's model class (torch): see mawforge/archs/llama4/__init__.py for the facts."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from mawforge.codecs import quants
from mawforge.kernels import linear, native
from mawforge.models.base import MoETransformer, attend


def input_major_expert(x: torch.Tensor, parts: dict) -> torch.Tensor:
    """One routed expert stored as HF keeps it (x @ W). x [n, C] -> [n, C]."""
    if "gate_up_t" not in parts:
        g, u = linear(x, parts["gate"]).float(), linear(x, parts["up"]).float()
        return linear(F.silu(g) * u, parts["down"]).float()
    g, u = (x.float() @ quants.dequantize(parts["gate_up_t"])).chunk(2, dim=-1)   # [n, F] each
    return (F.silu(g) * u) @ quants.dequantize(parts["down_t"])


def llama3_inv_freq(head_dim: int, base: float, s: dict | None) -> torch.Tensor:
    """transformers' _compute_llama3_parameters (float64 here): low frequencies divided by
    `factor`, high ones kept, a smooth ramp between. [D/2]"""
    inv = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if not s:
        return inv
    old, lo, hi, factor = s["original_context"], s["low_freq_factor"], s["high_freq_factor"], s["factor"]
    wavelen = 2 * math.pi / inv
    smooth = (old / wavelen - lo) / (hi - lo) if hi != lo else torch.zeros_like(inv)
    out = torch.where(wavelen > old / lo, inv / factor, inv)
    mid = (wavelen >= old / hi) & (wavelen <= old / lo)
    return torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, out)


def _unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class Llama4(MoETransformer):
    def __init__(self, cfg, weights, experts, device):
        super().__init__(cfg, weights, experts, device)
        a = cfg.args
        self.moe, self.rope_on, self.chunk = set(a.moe_layers), a.rope_layers, list(a.chunk)
        self.l2_qk, self.temp = a.l2_qk_norm, a.temperature
        if a.experts_input_major:
            self.expert_fn = input_major_expert
        inv = llama3_inv_freq(cfg.head_dim, cfg.rope_base, a.rope_scaling)
        if weights.has("rope_freqs.weight"):          # GGUF: llama3's per-pair divisors
            inv = inv / weights.dense("rope_freqs.weight").reshape(-1).double().cpu()
        self.inv_freq = inv.to(device)
        self._rot: tuple | None = None

    # ---- attention ---------------------------------------------------------------------
    def _cos_sin(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [T, D/2] for this chunk's positions, computed once per forward."""
        if self._rot is None or self._rot[0] is not pos:
            ang = pos.double()[:, None] * self.inv_freq[None]
            self._rot = (pos, ang.cos().float().contiguous(), ang.sin().float().contiguous())
        return self._rot[1], self._rot[2]

    def _rotate(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:   # x [T, heads, D]
        cos, sin = self._cos_sin(pos)
        if x.dtype == torch.float32 and x.device.type == "cpu" and native.available():
            return native.rope(x.contiguous(), cos, sin, False)
        c, s = cos[:, None], sin[:, None]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)

    def attention(self, layer: int, x: torch.Tensor, pos: torch.Tensor, kv) -> torch.Tensor:
        cfg, T, w = self.cfg, x.shape[0], self.layers[layer]       # weights bound at load
        H, G, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        q = linear(x, w["attn_q.weight"]).float().view(T, H, D)
        k = linear(x, w["attn_k.weight"]).float().view(T, G, D)
        v = linear(x, w["attn_v.weight"]).float().view(T, G, D)
        if self.rope_on[layer]:
            q, k = self._rotate(q, pos), self._rotate(k, pos)
            if self.l2_qk:
                q, k = _unit_rms(q, cfg.norm_eps), _unit_rms(k, cfg.norm_eps)
        elif self.temp:
            t = torch.log1p(torch.floor((pos.float() + 1.0) / self.temp["floor_scale"]))
            q = q * (t * self.temp["attn_scale"] + 1.0)[:, None, None]
        keys, vals = kv.append(layer, k, v)                                           # [G, S, D]
        out = self._attend_chunked(q, keys, vals, int(pos[0]), self.chunk[layer])     # [T, H*D]
        return linear(out, w["attn_output.weight"]).float()

    def _attend_chunked(self, q, keys, vals, pos0: int, chunk: int | None) -> torch.Tensor:
        """Causal attention; with a chunk, each run of queries inside one chunk attends to the
        keys from that chunk's start up to itself (exact: nothing of earlier chunks is seen)."""
        if chunk is None:
            return attend(q, keys, vals, self.scale)
        T, outs, a = q.shape[0], [], pos0
        while a < pos0 + T:
            start = a // chunk * chunk
            b = min(start + chunk, pos0 + T)
            outs.append(attend(q[a - pos0:b - pos0], keys[:, start:b], vals[:, start:b], self.scale))
            a = b
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    # ---- feed-forward ------------------------------------------------------------------
    def _swiglu(self, x: torch.Tensor, layer: int, suffix: str) -> torch.Tensor:
        """The dense MLP (suffix "") or the shared expert ("_shexp")."""
        w = self.layers[layer]
        g = linear(x, w[f"ffn_gate{suffix}.weight"]).float()
        u = linear(x, w[f"ffn_up{suffix}.weight"]).float()
        return linear(F.silu(g) * u, w[f"ffn_down{suffix}.weight"]).float()

    def route(self, layer: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k of the raw router logits; the weight is sigmoid(logit). idx, w [T, k]."""
        if layer not in self.moe:              # dense layer: no router (lookahead may still ask)
            none = torch.zeros(h.shape[0], 0, device=h.device)
            return none.long(), none
        logits = h.float() @ self.layers[layer]["ffn_gate_inp.weight"].T            # [T, E]
        top, idx = torch.topk(logits, self.cfg.top_k, dim=-1)                          # [T, k]
        return idx, torch.sigmoid(top)

    def ffn(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        if layer not in self.moe:
            return self._swiglu(x, layer, "")
        idx, wts = self.route(layer, x)
        y = self._swiglu(x, layer, "_shexp")                                               # [T, C]
        ones = torch.ones(x.shape[0], 1, device=x.device)
        for j in range(idx.shape[1]):          # the weight scales each chosen expert's input
            y = y + self.experts(layer, x * wts[:, j:j + 1], idx[:, j:j + 1], ones)
        return y
