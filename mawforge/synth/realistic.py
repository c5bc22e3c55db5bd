"""`synth --routing real`: routing calibrated to published measurements of real Qwen3-30B-A3B text,
per layer, instead of one Zipf skew and one stickiness for every layer.

What real routing shows (sources in docs/synth.md) and how a random-weight file is made to show it:

- **Recency.** 38-45% of a token's experts are the previous token's, fewer at lag 8 (27% on
  BigMoeOnEdge's trace), median reuse distance 2 tokens. Made by *local* attention layers whose
  softmax weights fall off with distance: their q and k projections get a column mean along the
  embeddings' shared direction `c`, so every token's q and k are nearly the same vector, and the
  per-head QK-norm weights (F32, which the file may set freely) weight the RoPE frequency pairs
  so that q·k as a function of the distance alone is a chosen kernel: ~rho^d for the last few
  tokens, fitted toward 12 nats below the peak beyond (`recency_norm_weights`; at head dim 128
  and rho 0.6 the 4,032 distances from 64 to 4,096 weigh 0.35 together against 3.7 for the last
  16 tokens, none over 0.2% of the nearest's weight). The attn_output
  scale of these layers is raised until the local context carries `local_share` of the router
  input's token-varying energy.
- **A per-sequence working set.** Within one text, a layer's routing is concentrated (entropy
  0.70-0.80 of uniform over 128 tokens) while a hot set learned on other texts covers only
  68-73% of held-out traffic. Made by the global-context attention synth's `--stickiness` uses,
  in the even layers, to `context_share`, over a weaker global popularity (Zipf `skew`).
- **A near-uniform first layer** (entropy 0.91, no recency): layer 0 keeps the init-like
  attention scale and a low skew (`first_skew`).

The values of REAL were chosen by measuring files made with them (`mawforge trace stats` on a
trace of sampled decoding, docs/synth.md has the table beside the published figures), not derived.

Legend: Dh head dim, J = Dh / 2 RoPE frequency pairs, d token distance.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RealRouting:
    skew: float = 0.7            # Zipf exponent of each layer's global popularity, layers >= 1
    first_skew: float = 0.25     # layer 0's
    local_share: float = 0.5     # local (recent-token) context's share of the router input's token variance
    context_share: float = 0.15  # global (prefix) context's share
    rho: float = 0.6             # the local kernel's decay a token of distance
    qk_mean: float = 0.25        # local layers' q/k column mean along c, in units of the projection std

    def kind(self, layer: int) -> str:
        """'plain' (layer 0), 'local' (odd layers) or 'context' (even layers from 2)."""
        return "plain" if layer == 0 else "local" if layer % 2 else "context"

    def skew_at(self, layer: int) -> float:
        return self.first_skew if layer == 0 else self.skew


REAL = RealRouting()


def recency_norm_weights(rho: float, head_dim: int, rope_base: float, span: int = 4096, floor: float = 12.0,
                         iters: int = 20000) -> np.ndarray:
    """QK-norm weights g [Dh] (the same for q and k) such that, for q = k = ones per head, the
    NEOX-RoPE attention score at distance d, (2 / sqrt(Dh)) * sum_j g_j^2 cos(theta_j d), follows
    d * ln(rho) from d = 0 down to -floor and stays near that out to `span`: nonnegative least
    squares by projected gradient over g_j^2, closer distances weighted 4x (a fit, not a bound;
    `kernel` gives what it reaches)."""
    theta = rope_base ** (-np.arange(head_dim // 2) * 2.0 / head_dim)                # [J]
    d = np.concatenate([np.arange(64), np.unique(np.geomspace(64, span, 400).astype(int))])
    x = np.hstack([2 / math.sqrt(head_dim) * np.cos(np.outer(d, theta)), -np.ones((len(d), 1))])
    target = np.maximum(d * math.log(rho), -floor)       # up to a constant, the last column's
    w = np.where(d < 32, 4.0, 1.0)[:, None]
    xw, tw = x * w, target * w[:, 0]
    a, step = np.zeros(x.shape[1]), 1.0 / np.linalg.norm(xw, 2) ** 2
    for _ in range(iters):
        a = np.maximum(a - step * (xw.T @ (xw @ a - tw)), 0.0)
    g = np.sqrt(a[:-1])
    return np.concatenate([g, g]).astype(np.float32)      # pair j is dims j and j + J


def kernel(g: np.ndarray, rope_base: float, span: int) -> np.ndarray:
    """Softmax weights over distances 0..span-1 (relative to distance 0) that g gives q = k = ones."""
    dh = len(g)
    theta = rope_base ** (-np.arange(dh // 2) * 2.0 / dh)
    a = g[: dh // 2].astype(np.float64) ** 2
    s = 2 / math.sqrt(dh) * np.cos(np.outer(np.arange(span), theta)) @ a
    return np.exp(s - s[0])
