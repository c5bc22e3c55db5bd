"""Lossy miss policies for decode (`--miss-policy exact|substitute|skip[:THRESHOLD]`), off by default.

A decode token's routed expert whose block is not in the expert cache is a miss: `exact` (the
default) reads it and computes what the model computes. The two lossy policies trade a measured
amount of quality for not waiting on that read, and only for misses whose gate weight (the
routing weight the model gives the expert, after its own normalization) is below the threshold;
a miss at or above it is read as in `exact`:

- `substitute`: the missed expert is replaced by the resident expert of the same layer with the
  highest router logit that the token did not already pick, at the missed one's gate weight (so
  the weights keep their sum). Where no such expert is resident the miss is read.
- Either way a row's highest-weight expert is always read and computed exactly.
- `skip`: the missed expert is left out. Where the architecture renormalizes its top-k weights
  (`norm_topk_prob`, Qwen3-MoE; gpt-oss's softmax over the chosen), the survivors are scaled back
  to the row's sum, as the router would have normalized them; elsewhere (OLMoE, Qwen2-MoE) they
  keep their weights, since renormalizing there changes what every other expert contributes.

A skipped entry becomes expert id -1 with weight 0: the cache driver accounts nothing for it,
and a route trace records it as -1 (docs/trace-format.md), so replay reproduces the counters of
a lossy run. MoEBlock applies the policy in decode steps only (the cache driver's step kind);
a prompt's prefill is always exact, since a lossy prompt would write its error into the KV cache
every later token reads. docs/miss-policy.md prices each setting.

Legend: T tokens, k experts per token, E experts in the layer.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from mawforge.errors import RequestError

MODES = ("exact", "substitute", "skip")
DEFAULT_THRESHOLD = 0.1
SKIPPED = -1


@dataclass
class MissPolicy:
    mode: str = "exact"
    threshold: float = DEFAULT_THRESHOLD
    counts: dict = field(default_factory=lambda: {"substituted": 0, "skipped": 0})

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise RequestError(f"unknown miss policy {self.mode!r}; choose one of {', '.join(MODES)}")
        if not 0.0 < self.threshold <= 1.0:
            raise RequestError(f"a miss policy's threshold is a gate weight in (0, 1], got {self.threshold}")

    @classmethod
    def parse(cls, spec: str | None) -> "MissPolicy":
        """'exact', 'substitute', 'skip', or either lossy one with ':THRESHOLD' (e.g. 'skip:0.05')."""
        mode, _, arg = (spec or "exact").strip().lower().partition(":")
        if not arg:
            return cls(mode)
        if mode == "exact":
            raise RequestError("the exact miss policy takes no threshold")
        try:
            threshold = float(arg)
        except ValueError:
            raise RequestError(f"a miss policy's threshold is a number, got {arg!r}") from None
        return cls(mode, threshold)

    @property
    def lossy(self) -> bool:
        return self.mode != "exact"

    def spec(self) -> str:
        return self.mode if not self.lossy else f"{self.mode}:{self.threshold:g}"

    def report(self) -> dict:
        return {"mode": self.mode, "threshold": self.threshold if self.lossy else None, **self.counts}

    def apply(self, layer: int, idx: np.ndarray, w: np.ndarray, resident: Callable[[tuple[int, int]], bool],
              logits: Callable[[], np.ndarray] | None, renorm: bool) -> tuple[np.ndarray, np.ndarray]:
        """idx/w [T, k] of one layer -> the routing the step computes (copies where changed).
        resident(key): whether the block is in the cache (or on its way); logits(): the layer's
        router logits [T, E], asked for only when a substitute is needed."""
        if not self.lossy:
            return idx, w
        low = w < self.threshold                                                    # [T, k]
        if not low.any():
            return idx, w
        out_i, out_w, scores = idx, w, None
        for t, j in zip(*np.nonzero(low)):
            e = int(idx[t, j])
            if resident((layer, e)) or j == int(np.argmax(w[t])):
                continue                                      # a row's strongest expert is always exact
            if self.mode == "skip":
                if out_i is idx:
                    out_i, out_w = idx.copy(), w.copy()
                out_i[t, j], out_w[t, j] = SKIPPED, 0.0
                self.counts["skipped"] += 1
                continue
            if logits is None:
                continue
            if scores is None:
                scores = np.asarray(logits(), dtype=np.float64)                     # [T, E]
            sub = self._best_resident(layer, scores[t], out_i[t], resident)
            if sub is None:
                continue
            if out_i is idx:
                out_i, out_w = idx.copy(), w.copy()
            out_i[t, j] = sub
            self.counts["substituted"] += 1
        if self.mode == "skip" and renorm and out_i is not idx:
            for t in np.unique(np.nonzero(out_i == SKIPPED)[0]):
                kept = out_w[t].sum()
                if kept > 0:
                    out_w[t] *= w[t].sum() / kept
        return out_i, out_w

    @staticmethod
    def _best_resident(layer: int, scores: np.ndarray, chosen: np.ndarray, resident) -> int | None:
        taken = set(int(e) for e in chosen)
        for e in np.argsort(-scores, kind="stable"):
            e = int(e)
            if e not in taken and resident((layer, e)):
                return e
        return None
