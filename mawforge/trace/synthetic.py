"""Synthetic route traces with controllable locality, for tests, demos and benchmarks.

Every trace made here carries `synthetic: true` and its parameters in its metadata, and
every replay output labels it SYNTHETIC: it says nothing about a real model's routing.

Knobs: `zipf` (per-layer popularity exponent; 0 = uniform, larger = a few hot experts),
`reuse` (probability that a token keeps the previous token's experts at a layer).
Experts are drawn without replacement by the Gumbel-top-k trick on log-popularity, which
samples k distinct experts in proportion to popularity, vectorized over tokens.

Legend: T tokens, L layers, E experts, k top-k.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np

from mawforge.errors import RequestError
from mawforge.trace.record import STEP_KINDS, Trace, TraceMeta, _block_table

CHUNK_TOKENS = 1024  # bounds the [T, L, E] score tensor


@dataclass(frozen=True)
class SyntheticSpec:
    n_layers: int = 4
    n_experts: int = 16
    top_k: int = 2
    decode_steps: int = 64
    prefill_tokens: int = 0  # one prefill step of this many tokens first (0: none)
    zipf: float | tuple[float, ...] = 1.0
    reuse: float = 0.0
    block_bytes: int | tuple[int, ...] = 1 << 20  # uniform, or one size per layer
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.n_layers, self.n_experts, self.top_k) <= 0 or self.top_k > self.n_experts:
            raise RequestError("synthetic trace needs positive layers/experts and top_k <= experts")
        if self.decode_steps < 0 or self.prefill_tokens < 0 or self.decode_steps + self.prefill_tokens == 0:
            raise RequestError("synthetic trace needs some prefill tokens or decode steps")
        if not 0.0 <= self.reuse <= 1.0:
            raise RequestError(f"reuse must be a probability, got {self.reuse}")
        if isinstance(self.zipf, tuple) and len(self.zipf) != self.n_layers:
            raise RequestError(f"give one zipf exponent per layer ({self.n_layers}), got {len(self.zipf)}")

    def zipf_per_layer(self) -> np.ndarray:  # [L]
        return np.broadcast_to(np.asarray(self.zipf, dtype=np.float64), (self.n_layers,))


def synthetic_trace(spec: SyntheticSpec) -> Trace:
    rng = np.random.default_rng(spec.seed)
    L, E, k = spec.n_layers, spec.n_experts, spec.top_k
    # Popularity: rank r gets 1 / r^zipf, over a random permutation of experts per layer.
    ranks = np.stack([rng.permutation(E) + 1 for _ in range(L)])  # [L, E]
    log_pop = -spec.zipf_per_layer()[:, None] * np.log(ranks)  # [L, E]
    n_tokens = spec.prefill_tokens + spec.decode_steps
    experts = np.empty((n_tokens, L, k), dtype=np.int16 if E < 32768 else np.int32)
    weights = np.empty((n_tokens, L, k), dtype=np.float32)
    for a in range(0, n_tokens, CHUNK_TOKENS):
        t = min(CHUNK_TOKENS, n_tokens - a)
        scores = log_pop[None] + rng.gumbel(size=(t, L, E))  # [t, L, E]
        top = np.argpartition(-scores, k - 1, axis=2)[:, :, :k]  # [t, L, k]
        top_scores = np.take_along_axis(scores, top, axis=2)
        order = np.argsort(-top_scores, axis=2, kind="stable")  # router order: best first
        experts[a:a + t] = np.take_along_axis(top, order, axis=2)
        w = np.exp(np.take_along_axis(top_scores, order, axis=2))
        weights[a:a + t] = w / w.sum(axis=2, keepdims=True)
    # Reuse: a token copies the previous token's choice; forward-fill from the last fresh one.
    fresh = rng.random((n_tokens, L)) >= spec.reuse  # [T, L]
    fresh[0] = True
    src = np.maximum.accumulate(np.where(fresh, np.arange(n_tokens)[:, None], 0), axis=0)  # [T, L]
    experts = np.take_along_axis(experts, src[:, :, None], axis=0)
    weights = np.take_along_axis(weights, src[:, :, None], axis=0)
    return _assemble(spec, experts, weights)


def _assemble(spec: SyntheticSpec, experts: np.ndarray, weights: np.ndarray) -> Trace:
    """[T, L, k] per-token routing -> records in step order, layers ascending."""
    L = spec.n_layers
    steps = ([spec.prefill_tokens] if spec.prefill_tokens else []) + [1] * spec.decode_steps
    kinds = ([STEP_KINDS.index("prefill")] if spec.prefill_tokens else []) \
        + [STEP_KINDS.index("decode")] * spec.decode_steps
    starts = np.concatenate([[0], np.cumsum(steps)])
    rows_e, rows_w = [], []
    for s in range(len(steps)):
        a, b = starts[s], starts[s + 1]
        rows_e.append(experts[a:b].transpose(1, 0, 2).reshape(-1, spec.top_k))  # [L*T, k]
        rows_w.append(weights[a:b].transpose(1, 0, 2).reshape(-1, spec.top_k))
    params = {key: (list(v) if isinstance(v, tuple) else v) for key, v in asdict(spec).items()}
    meta = TraceMeta(n_layers=L, n_experts=spec.n_experts, top_k=spec.top_k,
                     model=f"synthetic-{L}x{spec.n_experts}-top{spec.top_k}", synthetic=True,
                     synthetic_params=params)
    return Trace(
        meta=meta, block_bytes=_block_table(spec.block_bytes, L, spec.n_experts),
        step_kind=np.asarray(kinds, dtype=np.uint8), step_tokens=np.asarray(steps, dtype=np.int32),
        rec_step=np.repeat(np.arange(len(steps), dtype=np.int32), L),
        rec_layer=np.tile(np.arange(L, dtype=np.int32), len(steps)),
        experts=np.concatenate(rows_e), weights=np.concatenate(rows_w))


def _floats(text: str) -> float | tuple[float, ...]:
    vals = tuple(float(v) for v in text.split(","))
    return vals[0] if len(vals) == 1 else vals


def _ints(text: str) -> int | tuple[int, ...]:
    vals = tuple(int(v) for v in text.split(","))
    return vals[0] if len(vals) == 1 else vals


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--output", required=True, help="trace file to write (.npz)")
    parser.add_argument("--layers", type=int, default=SyntheticSpec.n_layers)
    parser.add_argument("--experts", type=int, default=SyntheticSpec.n_experts)
    parser.add_argument("--top-k", type=int, default=SyntheticSpec.top_k)
    parser.add_argument("--decode-steps", type=int, default=SyntheticSpec.decode_steps)
    parser.add_argument("--prefill-tokens", type=int, default=0)
    parser.add_argument("--zipf", type=_floats, default=1.0, help="exponent, or one per layer (a,b,...)")
    parser.add_argument("--reuse", type=float, default=0.0, help="P(token keeps previous token's experts)")
    parser.add_argument("--block-bytes", type=_ints, default=1 << 20, help="bytes, or one per layer")
    parser.add_argument("--seed", type=int, default=0)


def main(args: argparse.Namespace) -> int:
    spec = SyntheticSpec(n_layers=args.layers, n_experts=args.experts, top_k=args.top_k,
                         decode_steps=args.decode_steps, prefill_tokens=args.prefill_tokens,
                         zipf=args.zipf, reuse=args.reuse, block_bytes=args.block_bytes, seed=args.seed)
    path = synthetic_trace(spec).save(args.output)
    print(f"wrote SYNTHETIC trace {path} ({spec.n_layers} layers x {spec.n_experts} experts, "
          f"top-{spec.top_k}, {spec.prefill_tokens} prefill tokens + {spec.decode_steps} decode steps)")
    return 0


def generate(n_layers: int = 4, n_experts: int = 16, top_k: int = 2, decode_steps: int = 64,
             **kwargs) -> Trace:
    """Shorthand: synthetic_trace(SyntheticSpec(...))."""
    return synthetic_trace(SyntheticSpec(n_layers=n_layers, n_experts=n_experts, top_k=top_k,
                                         decode_steps=decode_steps, **kwargs))


__all__: Sequence[str] = ("SyntheticSpec", "synthetic_trace", "generate", "add_arguments", "main")
