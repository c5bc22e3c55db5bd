"""Gated delta-net (linear attention) as in Qwen3-Next / Qwen3.5: a causal depthwise convolution
over the mixed q|k|v projection, then the gated delta rule run token by token over a fixed
[Hv, Dk, Dv] state, then a gated RMSNorm and the output projection.

Legend: T tokens in the chunk, C hidden, Ch conv channels (2*Hk*Dk + Hv*Dv), K conv kernel,
Hk key heads, Hv value heads, Dk key head dim, Dv value head dim.

Checkpoint layouts differ in four ways, all read from config.args.linear or the names:
HF keeps A_log (llama.cpp stores ssm_a = -exp(A_log)); HF orders value heads grouped by key
head (v head j reads k head j // (Hv/Hk)), llama.cpp tiles them (k head j % Hk); the conv
kernel is [Ch, 1, K] in HF and [Ch, K] in GGUF (same bytes); Qwen3-Next fuses the input
projections per key head (ssm_in, ssm_ba; see DeltaNetMixer.project).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from mawforge.kernels import linear


def conv_inputs(x: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """x [T, Ch], state [Ch, K-1] (the previous K-1 inputs) -> [Ch, K-1+T]; the state keeps the last K-1."""
    xs = torch.cat((state, x.T.to(state.dtype)), dim=1)
    state.copy_(xs[:, xs.shape[1] - state.shape[1]:])
    return xs


def causal_conv(x: torch.Tensor, state: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, Ch], state [Ch, K-1] (updated in place), w [Ch, K] -> silu(conv) [T, Ch]."""
    xs = conv_inputs(x, state)                                                 # [Ch, K-1+T]
    out = F.conv1d(xs[None], w[:, None, :], groups=w.shape[0])[0]              # [Ch, T]
    return F.silu(out).T


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """q, k [T, Hv, Dk] (l2-normed, q scaled), v [T, Hv, Dv], g, beta [T, Hv]; state [Hv, Dk, Dv]
    updated in place -> out [T, Hv, Dv]. One token at a time: correctness first."""
    out = torch.empty_like(v)
    S = state
    for t in range(q.shape[0]):
        S = S * g[t].exp()[:, None, None]
        mem = (S * k[t][:, :, None]).sum(1)                                     # [Hv, Dv]
        delta = (v[t] - mem) * beta[t][:, None]
        S = S + k[t][:, :, None] * delta[:, None, :]
        out[t] = (S * q[t][:, :, None]).sum(1)
    state.copy_(S)
    return out


def replay(state: list[torch.Tensor], conv_in: torch.Tensor, q, k, v, g, beta) -> None:
    """Advance a layer's [conv, recurrent] state over recorded chunk inputs, as the forward did."""
    conv_inputs(conv_in, state[0])
    gated_delta_rule(q, k, v, g, beta, state[1])


class DeltaNetMixer:
    """One linear-attention layer's token mixer over the layer's tensors bound at load
    (models/bound.py: layers[N][suffix]), suffixes {attn_qkv, attn_gate | ssm_in, ssm_beta,
    ssm_alpha | ssm_ba, ssm_conv1d, ssm_dt.bias, ssm_a | ssm_a_log, ssm_norm, ssm_out}."""

    def __init__(self, layers: list[dict], spec: dict, eps: float):
        self.layers, self.eps = layers, eps
        self.hk, self.hv, self.dk, self.dv = spec["k_heads"], spec["v_heads"], spec["k_dim"], spec["v_dim"]
        self.tiled = spec.get("v_order", "grouped") == "tiled"
        self._a: dict[int, torch.Tensor] = {}

    def decay_rate(self, layer: int) -> torch.Tensor:
        """-exp(A_log) per value head [Hv]."""
        if layer not in self._a:
            lw = self.layers[layer]
            self._a[layer] = (lw["ssm_a"] if "ssm_a" in lw
                              else -lw["ssm_a_log"].exp()).reshape(-1)
        return self._a[layer]

    def project(self, lw: dict, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [T, C] -> q|k|v before the conv [T, Ch], z [T, Hv, Dv], b and a [T, Hv], from whichever
        layout the checkpoint has: split (attn_qkv, attn_gate, ssm_beta, ssm_alpha: Qwen3.5, and
        Qwen3-Next's GGUF q|k|v and z) or fused per key head (Qwen3-Next): ssm_in rows are
        [q (Dk), k (Dk), v (r*Dv), z (r*Dv)] per key head (HF in_proj_qkvz, older GGUFs), ssm_ba
        rows [b (r), a (r)] per key head (HF in_proj_ba). r = Hv / Hk."""
        T, hk, hv, dk, dv = x.shape[0], self.hk, self.hv, self.dk, self.dv
        r = hv // hk
        if "ssm_in.weight" in lw:
            y = linear(x, lw["ssm_in.weight"]).float().view(T, hk, 2 * dk + 2 * r * dv)
            q, k, v, z = y.split((dk, dk, r * dv, r * dv), dim=-1)
            mixed = torch.cat((q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)), dim=-1)   # [T, Ch]
        else:
            mixed = linear(x, lw["attn_qkv.weight"]).float()      # [T, Ch]
            z = linear(x, lw["attn_gate.weight"]).float()
        if "ssm_ba.weight" in lw:
            ba = linear(x, lw["ssm_ba.weight"]).float().view(T, hk, 2 * r)
            b, a = ba[..., :r].reshape(T, hv), ba[..., r:].reshape(T, hv)         # [T, Hv]
        else:
            b = linear(x, lw["ssm_beta.weight"]).float()
            a = linear(x, lw["ssm_alpha.weight"]).float()
        return mixed, z.reshape(T, hv, dv), b, a

    def __call__(self, layer: int, x: torch.Tensor, state: list[torch.Tensor],
                 trail: list | None = None) -> torch.Tensor:
        """trail: the KV cache's recorder for this layer (models/kv.py) while a rollback mark is set;
        the chunk leaves its recurrence inputs there so the state can be replayed to any prefix."""
        lw, T = self.layers[layer], x.shape[0]
        hk, hv, dk, dv = self.hk, self.hv, self.dk, self.dv
        mixed, z, b, a = self.project(lw, x)
        conv_w = lw["ssm_conv1d.weight"]
        conv_in = mixed
        mixed = causal_conv(mixed, state[0], conv_w.reshape(conv_w.shape[0], -1))
        q, k, v = mixed.split((hk * dk, hk * dk, hv * dv), dim=-1)
        q, k = l2norm(q.reshape(T, hk, dk)) * dk ** -0.5, l2norm(k.reshape(T, hk, dk))
        if hv != hk:
            r = hv // hk
            q, k = ((q.repeat(1, r, 1), k.repeat(1, r, 1)) if self.tiled
                    else (q.repeat_interleave(r, 1), k.repeat_interleave(r, 1)))    # [T, Hv, Dk]
        g = self.decay_rate(layer) * F.softplus(a + lw["ssm_dt.bias"])
        v, beta = v.reshape(T, hv, dv), torch.sigmoid(b)
        o = gated_delta_rule(q, k, v, g, beta, state[1])
        if trail is not None:
            trail.append((T, lambda st, m: replay(st, conv_in[:m], q[:m], k[:m], v[:m], g[:m], beta[:m])))
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps) * lw["ssm_norm.weight"]
        o = (o * F.silu(z)).reshape(T, hv * dv)
        return linear(o, lw["ssm_out.weight"]).float()
