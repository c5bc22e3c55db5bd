"""Shared blocks: RMSNorm, RoPE (both layouts), grouped-query attention over a KV cache,
routing, and the decoder loop every MoE architecture file builds on.

Legend: T tokens in the chunk, C hidden, H query heads, G kv heads, D head dim,
S cached positions, E experts, k experts per token, V vocab.
"""
from __future__ import annotations

import math
from typing import Callable, ClassVar

import numpy as np
import torch

from mawforge.formats.config import ModelConfig
from mawforge.kernels import linear, native, q8_0
from mawforge.models.bound import bind_layers
from mawforge.models.fastpath import DecodeAttention
from mawforge.models.moe import MoEBlock


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """As ggml's rms_norm: squares summed in float64, scale = 1 / sqrt(mean + eps) in float32.
    On the CPU one native call computes it, summing in order as ggml does (torch's float64 sum
    runs in another order, so the mean can differ in its last bit)."""
    x32 = x.float()
    if (x32.device.type == "cpu" and w.dtype == torch.float32 and w.dim() == 1 and w.numel() == x32.shape[-1]
            and w.is_contiguous() and native.available()):
        return native.rms_norm(x32, w, eps)
    mean = (torch.sum(x32 * x32, -1, keepdim=True, dtype=torch.float64) / x32.shape[-1]).float()
    return x32 * mean.add_(eps).sqrt_().reciprocal_() * w


class Rope:
    """Rotary embedding; "neox" rotates halves, "norm" rotates interleaved pairs.

    cos/sin come from a table over positions, grown on demand (one lookup a layer instead of
    recomputing the angles). Without YaRN the angles are ggml's: theta_0 = p and theta_i =
    theta_{i-1} * base^(-2/D), multiplied in float32 pair by pair, as llama.cpp's rope cache."""

    def __init__(self, head_dim: int, base: float, layout: str, device: torch.device, yarn: dict | None = None):
        self.layout, self.half, self.head_dim, self.base = layout, head_dim // 2, head_dim, base
        self.device = device
        self.inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim))
        self.mscale = 1.0
        self.yarn = bool(yarn)
        if yarn:
            self.inv_freq, self.mscale = _yarn(self.inv_freq, head_dim, base, yarn)
        self.cos = self.sin = torch.empty(0, self.half, device=device)

    def _grow(self, n: int) -> None:
        n = max(n, 2 * self.cos.shape[0], 256)
        if self.yarn:
            ang = (torch.arange(n, dtype=torch.float64, device=self.device)[:, None]
                   * self.inv_freq[None]).float().double()
        else:
            scale = np.power(np.float32(self.base), np.float32(-2.0) / np.float32(self.head_dim), dtype=np.float32)
            theta = np.empty((n, self.half), np.float32)
            theta[:, 0] = np.arange(n, dtype=np.float32)
            for i in range(1, self.half):
                theta[:, i] = theta[:, i - 1] * scale
            ang = torch.from_numpy(theta.astype(np.float64)).to(self.device)
        self.cos = (ang.cos().float() * self.mscale).contiguous()                 # [P, D/2]
        self.sin = (ang.sin().float() * self.mscale).contiguous()

    def at(self, p: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [D/2] of position p (the rows __call__ rotates that position by)."""
        if p >= self.cos.shape[0]:
            self._grow(p + 1)
        return self.cos[p], self.sin[p]

    def __call__(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:   # x [T, H, D], pos [T]
        end = int(pos[-1]) + 1 if pos.numel() else 0
        if end > self.cos.shape[0]:
            self._grow(end)
        if pos.numel() == 1:
            p = int(pos[0])
            cos, sin = self.cos[p:p + 1, None], self.sin[p:p + 1, None]           # [1, 1, D/2]
        else:
            cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]             # [T, 1, D/2]
        if x.dtype == torch.float32 and x.device.type == "cpu" and native.available():
            return native.rope(x, cos[:, 0], sin[:, 0], self.layout == "neox")
        if self.layout == "neox":
            x1, x2 = x[..., :self.half], x[..., self.half:]
            return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


def rope_inv_freq(base: float, dims: int, device) -> torch.Tensor:
    """Inverse frequencies of a NEOX rotation over the first `dims` dims of a head (partial
    rotary: GLM-4.5, Qwen3.5/Next); float32 as transformers computes them. -> [dims/2]"""
    return (1.0 / base ** (torch.arange(0, dims, 2, dtype=torch.float32) / dims)).to(device)


def rope_rotate(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """NEOX rotation of the first 2*len(inv_freq) dims (halves of that span); the rest pass.
    x [T, H, D], pos [T], inv_freq [R] float32 (zeros leave their pair unrotated)."""
    r = inv_freq.shape[0]
    ang = pos.float()[:, None] * inv_freq[None]                                # [T, R]
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]                           # [T, 1, R]
    x1, x2, rest = x[..., :r], x[..., r:2 * r], x[..., 2 * r:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)


# the torch path's scores and probabilities of one call at most (float32 [H, T, S] each): a longer
# chunk goes through in slices of queries (plan.py attention_bytes counts the same bound)
ATTN_SCORES_BYTES = 64 << 20


def attend(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, scale: float,
           window: int | None = None, rotated: bool = True) -> torch.Tensor:
    """Causal GQA over cached keys. q [T, H, D], keys/vals [G, S, D] (the last T are the chunk's
    own) -> [T, H*D]. window: a query sees only the last `window` positions (itself included).

    With a float16/bfloat16 cache this computes as llama.cpp's CPU attention does: q rounded to
    the cache dtype, q.k and p.v accumulated in float32, softmax in float32, the probabilities
    rounded to the cache dtype before p.v (ggml's mul_mat converts src1 to the f16 vec_dot type).
    With a q8_0 cache (uint8 rows, kernels/q8_0.py) as llama.cpp's flash attention over one: q rotated
    as the cached keys and through q8_0 (K's vec-dot type), the rows dequantized, the probabilities
    kept in float32, the output rotated back from the values' basis (rotated: the cache's
    KVCache.rotated; without it no rotation).
    On the CPU (no window) one native call computes it (kernels/native attend_rows: the same steps,
    summed in its own fixed order, every token's row alone), so a prefill row is the bits of the
    decode step at its position, the call a fused decode layer makes (models/fastpath.py), and no
    [chunk, S] score matrix or float32 copy of the cache is made."""
    T, H, D = q.shape
    if window is None and native.attend_takes(q, keys, vals):
        return native.attend_rows(q, keys, vals, scale, rotated)   # one call, as a decode layer's
    G, S = keys.shape[0], keys.shape[1]
    step = max(1, ATTN_SCORES_BYTES // (8 * H * S))
    if T > step:        # scores and probabilities [H, T, S] float32 within ATTN_SCORES_BYTES (plan.py counts it)
        return torch.cat([attend(q[a:a + step], keys[:, :S - T + min(a + step, T)], vals[:, :S - T + min(a + step, T)],
                                 scale, window, rotated) for a in range(0, T, step)])
    quant = keys.dtype == torch.uint8       # q8_0 rows: q through q8_0, probabilities float32 (ggml's flash attention)
    low = keys.dtype != torch.float32 and not quant
    # [G, H/G*T, D]; one token is that layout already (the permute and copy would be no-ops)
    qg = q.view(G, H // G, D) if T == 1 else q.view(T, G, H // G, D).permute(1, 2, 0, 3).reshape(G, H // G * T, D)
    if quant:
        qg = q8_0.query(qg, rotated)
    elif low:
        qg = qg.to(keys.dtype)
    scores = torch.bmm(qg.float(), q8_0.rows_float(keys).transpose(1, 2)).mul_(scale)   # [G, H/G*T, S]
    if window is not None:
        qpos = S - T + torch.arange(T, device=q.device)[:, None]                # [T, 1]
        kpos = torch.arange(S, device=q.device)[None]                           # [1, S]
        scores.view(G, H // G, T, S).masked_fill_((kpos > qpos) | (kpos <= qpos - window), float("-inf"))
    elif T > 1:     # only the chunk's own T columns can lie in a query's future: mask those alone
        t = torch.arange(T, device=q.device)
        scores.view(G, H // G, T, S)[..., S - T:].masked_fill_(t[None] > t[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if low:
        probs = probs.to(vals.dtype)
    out = torch.bmm(probs.float(), q8_0.rows_float(vals))                        # [G, H/G*T, D]
    if quant:
        out = q8_0.output(out, rotated)
    if T == 1:
        return out.view(1, H * D)
    return out.view(G, H // G, T, D).permute(2, 0, 1, 3).reshape(T, H * D)


def _yarn(inv_freq: torch.Tensor, dim: int, base: float, y: dict) -> tuple[torch.Tensor, float]:
    """YaRN (transformers' _compute_yarn_parameters, llama.cpp's rope_yarn): interpolate the low
    frequencies by `factor`, keep the high ones, ramp between; cos/sin scaled by attn_factor."""
    def corr(rot: float) -> float:
        return dim * math.log(y["original_context"] / (rot * 2 * math.pi)) / (2 * math.log(base))
    lo, hi = corr(y["beta_fast"]), corr(y["beta_slow"])
    if y.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    hi = hi + 0.001 if lo == hi else hi
    ramp = ((torch.arange(dim // 2, dtype=torch.float64, device=inv_freq.device) - lo) / (hi - lo)).clamp(0, 1)
    keep = 1 - ramp                                                               # 1: extrapolate (high freq)
    return inv_freq / y["factor"] * (1 - keep) + inv_freq * keep, float(y.get("attn_factor", 1.0))


def route_softmax_topk(logits: torch.Tensor, k: int, renorm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts, top-k, optional renormalization. logits [T, E] -> idx, w [T, k]."""
    probs = torch.softmax(logits.float(), dim=-1)
    w, idx = torch.topk(probs, k, dim=-1)
    if renorm:
        w = w / w.sum(-1, keepdim=True)
    return idx, w


class MoETransformer:
    """The one decoder loop. An architecture's model.py subclasses it and overrides the
    per-layer blocks that differ (mixer, ffn, norms, routing, what runs beside the routed
    experts), never the loop itself:

        h = embed(tokens)
        per layer:  h = layer_out(h + mixer_out(mixer(norm(h, attn_norm))))
                    x = ffn_input(h);  h = layer_out(h + ffn(x))
        logits(norm(h, output_norm))
    """

    ffn_norm_name: ClassVar[str] = "ffn_norm.weight"
    # What one routed expert computes on its block (None: SwiGLU, models/moe.py swiglu_expert,
    # which the native kernel may fuse). An instance may set its own (gpt-oss binds its limits).
    expert_fn: ClassVar[Callable | None] = None

    def __init__(self, cfg: ModelConfig, weights, experts, device: torch.device):
        self.cfg, self.w, self.device = cfg, weights, device
        self.experts = MoEBlock(experts, lambda: self.expert_fn)
        self.experts.router_logits, self.experts.renorm = self.router_logits, cfg.norm_topk_prob
        self.rope = Rope(cfg.head_dim, cfg.rope_base, cfg.rope_layout, device)
        self.scale = cfg.head_dim ** -0.5
        self.layers = bind_layers(cfg, weights)
        # every layer's norm weights and the final one, as norm() computes with them, bound once
        self.norms = [{s: self.norm_weight(w) for s, w in lw.items() if "norm" in s and isinstance(w, torch.Tensor)}
                      for lw in self.layers]
        self.output_norm = self.norm_weight(weights.dense("output_norm.weight"))
        # the one-token attention step in one native call, where it gives the same bits (fastpath.py)
        self.decode_attention = DecodeAttention.plan(self)
        # a batch's coordinator (engine/batch.py): gate(model, rows) -> the rows' logits once the LM
        # head ran over every sequence of the step, or None to compute them here at once
        self.gate = None

    # ---- hooks -------------------------------------------------------------------------
    def norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x normed with a bound norm weight (self.norms, self.output_norm)."""
        return rms_norm(x, w, self.cfg.norm_eps)

    def norm_weight(self, w: torch.Tensor) -> torch.Tensor:
        """A norm weight as norm() takes it, made once at load (an architecture may offset it)."""
        return w

    def layer_norm(self, layer: int, x: torch.Tensor, suffix: str) -> torch.Tensor:
        """x normed with blk.{layer}.{suffix} as bound at load."""
        return self.norm(x, self.norms[layer][suffix])

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.w.embed(tokens)                                               # [T, C] f32

    def qk_norm(self, layer: int, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm of q and k [T, H*D] / [T, G*D] before RoPE, as cfg.qk_norm says: "head" per
        head (Qwen3-MoE), "full" over the whole projection (OLMoE), "none" not at all."""
        cfg = self.cfg
        if cfg.qk_norm == "none":
            return q, k
        nq, nk = self._bound(layer, "attn_q_norm.weight"), self._bound(layer, "attn_k_norm.weight")
        if cfg.qk_norm == "full":
            return rms_norm(q, nq, cfg.norm_eps), rms_norm(k, nk, cfg.norm_eps)
        T = q.shape[0]
        q = rms_norm(q.view(T, cfg.n_heads, cfg.head_dim), nq, cfg.norm_eps)
        k = rms_norm(k.view(T, cfg.n_kv_heads, cfg.head_dim), nk, cfg.norm_eps)
        return q.reshape(T, -1), k.reshape(T, -1)

    def route(self, layer: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w = self._bound(layer, "ffn_gate_inp.weight")                              # [E, C]
        if native.route_takes(h, w):     # every row routed as a decode layer routes its token (row-exact)
            return native.route_topk(h, w, self.cfg.top_k, self.cfg.norm_topk_prob)
        return route_softmax_topk(h @ w.T, self.cfg.top_k, self.cfg.norm_topk_prob)

    def router_logits(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """The router's score of every expert [T, E] for the FFN input h: what a lossy miss
        policy ranks resident substitutes by (models/miss_policy.py)."""
        return h.float() @ self._bound(layer, "ffn_gate_inp.weight").float().T

    def beside_experts(self, layer: int, h: torch.Tensor) -> torch.Tensor | None:
        return None

    def mixer(self, layer: int, x: torch.Tensor, pos: torch.Tensor, kv) -> torch.Tensor:
        """What mixes tokens in this layer: attention, unless an architecture says otherwise."""
        return self.attention(layer, x, pos, kv)

    def mixer_out(self, layer: int, a: torch.Tensor) -> torch.Tensor:
        return a

    def ffn_input(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        return self.layer_norm(layer, h, self.ffn_norm_name)

    def layer_out(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        return h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return linear(h, self.w.head()).float()                                   # [T, V]

    def keeps_hidden(self) -> bool:
        """True when every position's final hidden state is needed (MTP drafting reads them)."""
        return False

    def keep_hidden(self, pos0: int, h: torch.Tensor) -> None:
        pass

    def fast_for(self, kv):
        """The fused one-token path for this KV cache: the model's own, or the one a batch's
        sequence carries (engine/batch.py: its buffers and bound KV pointers are one sequence's)."""
        own = getattr(kv, "fast", None)
        return own if own is not None else self.decode_attention

    # ---- blocks ------------------------------------------------------------------------
    def _bound(self, layer: int, suffix: str):
        """blk.{layer}.{suffix} as bound at load (models/bound.py; a dict lookup, no name
        formatting), or looked up by name past the layers the pack has."""
        w = self.layers[layer].get(suffix) if layer < len(self.layers) else None
        return w if w is not None else self.w.bind(f"blk.{layer}.{suffix}")

    def proj(self, name: str, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.w.packed(name))
        b = self.w.maybe_dense(name.replace(".weight", ".bias"))
        return y if b is None else y + b

    def attention(self, layer: int, x: torch.Tensor, pos: torch.Tensor, kv) -> torch.Tensor:
        cfg, T = self.cfg, x.shape[0]
        H, G, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        p = f"blk.{layer}."
        fast = self.fast_for(kv)
        if fast is not None and T == 1 and x.dtype == torch.float32 and layer < len(fast.layers):
            q, k, v = fast.qkv(layer, x, pos)                                     # [1, H, D], [1, G, D] x2
        else:
            q = self.proj(p + "attn_q.weight", x).float()                         # [T, H*D]
            k = self.proj(p + "attn_k.weight", x).float()                         # [T, G*D]
            v = self.proj(p + "attn_v.weight", x).float()
            q, k = self.qk_norm(layer, q, k)
            q = self.rope(q.view(T, H, D), pos)
            k = self.rope(k.view(T, G, D), pos)
            v = v.view(T, G, D)
        keys, vals = kv.append(layer, k, v)                                        # [G, S, D]
        out = attend(q, keys, vals, self.scale, rotated=kv.rotated)                # [T, H*D]
        return self.proj(p + "attn_output.weight", out)

    def ffn(self, layer: int, x: torch.Tensor, routed: tuple | None = None) -> torch.Tensor:
        """routed: (idx, wts) [T, k] where the fused decode layer has routed x already."""
        idx, wts = self.route(layer, x) if routed is None else routed              # [T, k]
        y = self.experts(layer, x, idx, wts)
        extra = self.beside_experts(layer, x)
        return y if extra is None else y + extra

    # ---- the loop ----------------------------------------------------------------------
    def forward(self, tokens: torch.Tensor, pos0: int, kv, all_logits: bool = False,
                chunk: int | None = None, on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """tokens [T] -> logits [T, V] (or [1, V] for the last position). chunk, on_layer: hidden()'s."""
        keep = self.keeps_hidden()
        h = self.hidden(tokens, pos0, kv, last_only=not (all_logits or keep), chunk=chunk, on_layer=on_layer)
        if keep:
            self.keep_hidden(pos0, h)
        rows = h if all_logits else h[-1:]
        if self.gate is not None:           # a batch's step: one LM head call for all its sequences
            out = self.gate(self, rows)
            if out is not None:
                return out
        return self.logits(rows)

    def hidden(self, tokens: torch.Tensor, pos0: int, kv, last_only: bool = False, chunk: int | None = None,
               on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """tokens [T] -> final-normed hidden states [T, C] (the LM head's and an MTP layer's
        input), or only the last row's [1, C].

        Layer-major (a prefill wave): every token goes through a layer before the next layer
        starts. The mixer runs over `chunk` tokens at a time in order (attention's scores stay
        [chunk, S]; a delta-net's recurrence runs as chunk by chunk), the rest of the layer over
        all T at once, so the MoE block asks the cache for each routed block once per layer and
        computes each expert on every token routed to it (expert-major). on_layer(layer) is
        called after each layer (prefill progress)."""
        pos = torch.arange(pos0, pos0 + tokens.shape[0], device=self.device)
        h = self.embed(tokens)                                                    # [T, C]
        fast = self.fast_for(kv)
        step = fast.layer_step(h, pos0, kv) if fast is not None else None
        if step is not None:
            h = h.clone()                   # the fused call adds into h in place
        for layer in range(self.cfg.n_layers):
            if step is not None:            # one token: everything up to the experts in one call
                x, routed = step(layer, h)
            else:
                h = h + self.mix(layer, h, pos, kv, chunk)
                x, routed = self.ffn_input(layer, h), None
            self.experts.lookahead(layer, x, self.route, self.cfg.n_layers, self.cfg.args.dense_layers)
            y = self.ffn(layer, x) if routed is None else self.ffn(layer, x, routed)   # routed: the shared ffn only
            h = self.layer_out(layer, h + y)
            if on_layer is not None:
                on_layer(layer)
        return self.norm(h[-1:] if last_only else h, self.output_norm)

    def mix(self, layer: int, h: torch.Tensor, pos: torch.Tensor, kv, chunk: int | None = None) -> torch.Tensor:
        """mixer_out(mixer(attn_norm(h))) [T, C], over `chunk` rows at a time where T is longer:
        chunk c writes its KV (or advances the recurrent state) after the chunks before it and
        attends to them, the same operations on the same rows as one forward per chunk."""
        T, w = h.shape[0], self.norms[layer]["attn_norm.weight"]
        if chunk is None or T <= chunk:
            return self.mixer_out(layer, self.mixer(layer, self.norm(h, w), pos, kv))
        parts = []
        for a in range(0, T, chunk):
            b = min(a + chunk, T)
            with kv.ahead(a):
                parts.append(self.mixer_out(layer, self.mixer(layer, self.norm(h[a:b], w), pos[a:b], kv)))
        return torch.cat(parts)
