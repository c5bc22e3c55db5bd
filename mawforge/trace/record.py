"""Route traces: what the router chose, per step and MoE layer, recorded live and replayed
offline. The file is one compressed .npz (no pickles); docs/trace-format.md is the schema.

Legend: S steps, R layer records, N routing rows (sum over records of the step's tokens),
k experts per token, L layers, E experts per layer.
"""

from __future__ import annotations

import json
import os
import time
import zipfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from mawforge.cache.observer import CacheObserver
from mawforge.errors import FormatError

SCHEMA = "mawforge.trace"
SCHEMA_VERSION = 1
STEP_KINDS = ("prefill", "decode")
LIVE_COUNTERS = ("hits", "misses", "evictions", "materialized_bytes", "prefetch_issued")
ARRAYS = ("meta", "block_bytes", "step_kind", "step_tokens", "rec_step", "rec_layer",
          "experts", "weights")
# Optional (absent in traces recorded before `--prefetch auto`): each step's prefetch state,
# and each live lookahead prefetch: its step, the number of the step's records before it, and
# its keys (la_keys[la_start[q]:la_start[q+1]], rows of (layer, expert)).
LIVE_ARRAYS = ("step_prefetch", "la_step", "la_rec", "la_start", "la_keys")


@dataclass(frozen=True)
class TraceMeta:
    n_layers: int
    n_experts: int
    top_k: int
    model: str = ""
    pack_digest: str = ""
    synthetic: bool = False
    synthetic_params: dict | None = None
    created: str = ""
    live: dict | None = None  # the live cache config and counters, for replay's live check
    schema: str = SCHEMA
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        if self.schema != SCHEMA or self.schema_version != SCHEMA_VERSION:
            raise FormatError(f"trace schema {self.schema}/{self.schema_version} is not "
                              f"{SCHEMA}/{SCHEMA_VERSION}")
        for name in ("n_layers", "n_experts", "top_k"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise FormatError(f"trace metadata {name} must be a positive integer")
        if self.top_k > self.n_experts:
            raise FormatError(f"trace top_k {self.top_k} exceeds n_experts {self.n_experts}")

    @property
    def label(self) -> str:
        return "SYNTHETIC" if self.synthetic else "recorded"


@dataclass(frozen=True)
class TraceStep:
    kind: str
    n_tokens: int
    layers: list[tuple[int, np.ndarray, np.ndarray]]  # (layer, experts [T, k], weights [T, k])


@dataclass(frozen=True)
class Trace:
    meta: TraceMeta
    block_bytes: np.ndarray  # [L, E] int64
    step_kind: np.ndarray  # [S] uint8, index into STEP_KINDS
    step_tokens: np.ndarray  # [S] int32
    rec_step: np.ndarray  # [R] int32, non-decreasing
    rec_layer: np.ndarray  # [R] int32
    experts: np.ndarray  # [N, k] int
    weights: np.ndarray  # [N, k] float32
    step_prefetch: np.ndarray | None = None  # [S] uint8, 1: the step prefetched
    la_step: np.ndarray | None = None   # [Q] int32, step of each lookahead prefetch
    la_rec: np.ndarray | None = None    # [Q] int32, records of that step before it
    la_start: np.ndarray | None = None  # [Q + 1] int64, offsets into la_keys
    la_keys: np.ndarray | None = None   # [K, 2] int32, (layer, expert)
    rec_start: np.ndarray = field(init=False, repr=False)  # [R + 1] row offsets

    def __post_init__(self) -> None:
        m, k = self.meta, self.meta.top_k
        shape_checks = [
            (self.block_bytes.shape == (m.n_layers, m.n_experts), "block_bytes is not [n_layers, n_experts]"),
            (self.step_kind.ndim == 1 and self.step_tokens.shape == self.step_kind.shape,
             "step arrays disagree"),
            (self.rec_step.ndim == 1 and self.rec_layer.shape == self.rec_step.shape,
             "record arrays disagree"),
            (self.experts.ndim == 2 and self.experts.shape[1] == k, f"experts is not [N, {k}]"),
            (self.weights.shape == self.experts.shape, "weights and experts shapes differ"),
        ]
        for ok, msg in shape_checks:
            if not ok:
                raise FormatError(f"bad trace: {msg}")
        kinds = (self.block_bytes.dtype.kind, self.experts.dtype.kind, self.weights.dtype.kind)
        ints = (self.block_bytes, self.experts, self.step_kind, self.step_tokens,
                self.rec_step, self.rec_layer)
        if any(a.dtype.kind not in "iu" for a in ints) or kinds[2] != "f":
            raise FormatError("bad trace: index arrays must be integers and weights floats")
        n_steps = len(self.step_kind)
        value_checks = [
            (np.all(self.block_bytes > 0), "block sizes must be positive"),
            (np.all(self.step_kind < len(STEP_KINDS)), "unknown step kind"),
            (np.all(self.step_tokens > 0), "steps need at least one token"),
            (np.all((self.rec_step >= 0) & (self.rec_step < n_steps)), "record step out of range"),
            (np.all(np.diff(self.rec_step) >= 0), "records are not in step order"),
            (np.all((self.rec_layer >= 0) & (self.rec_layer < m.n_layers)), "record layer out of range"),
            # -1: a miss a lossy decode skipped (models/miss_policy.py); nothing was read for it
            (np.all((self.experts >= -1) & (self.experts < m.n_experts)), "expert id out of range"),
            (np.all(np.isfinite(self.weights)), "weights are not finite"),
        ]
        for ok, msg in value_checks:
            if not ok:
                raise FormatError(f"bad trace: {msg}")
        rows = self.step_tokens[self.rec_step].astype(np.int64)
        start = np.concatenate([[0], np.cumsum(rows)])
        if start[-1] != len(self.experts):
            raise FormatError(f"bad trace: records cover {start[-1]} rows, file has {len(self.experts)}")
        object.__setattr__(self, "rec_start", start)
        self._check_live_arrays()

    def _check_live_arrays(self) -> None:
        present = [getattr(self, n) is not None for n in LIVE_ARRAYS]
        if not any(present):
            return
        if not all(present):
            raise FormatError(f"bad trace: it must carry all or none of {', '.join(LIVE_ARRAYS)}")
        arrays = [getattr(self, n) for n in LIVE_ARRAYS]
        if any(a.dtype.kind not in "iu" for a in arrays):
            raise FormatError("bad trace: prefetch arrays must be integers")
        q, m = len(self.la_step), self.meta
        checks = [
            (self.step_prefetch.shape == self.step_kind.shape, "step_prefetch is not [S]"),
            (np.all(self.step_prefetch <= 1), "step_prefetch holds values other than 0 and 1"),
            (self.la_step.ndim == 1 and self.la_rec.shape == (q,) and self.la_start.shape == (q + 1,),
             "lookahead arrays disagree"),
            (self.la_keys.ndim == 2 and self.la_keys.shape[1] == 2, "la_keys is not [K, 2]"),
            (np.all((self.la_step >= 0) & (self.la_step < self.n_steps)), "lookahead step out of range"),
            (np.all(np.diff(self.la_step) >= 0), "lookahead prefetches are not in step order"),
            (q == 0 or (self.la_start[0] == 0 and np.all(np.diff(self.la_start) >= 0)
                        and self.la_start[-1] == len(self.la_keys)), "la_start does not cover la_keys"),
            (np.all((self.la_keys[:, 0] >= 0) & (self.la_keys[:, 0] < m.n_layers)
                    & (self.la_keys[:, 1] >= 0) & (self.la_keys[:, 1] < m.n_experts)), "lookahead key out of range"),
        ]
        for ok, msg in checks:
            if not ok:
                raise FormatError(f"bad trace: {msg}")
        per_step = np.bincount(self.rec_step, minlength=self.n_steps)
        if q and np.any((self.la_rec < 0) | (self.la_rec > per_step[self.la_step])):
            raise FormatError("bad trace: lookahead record position out of range")

    @property
    def has_live_prefetch(self) -> bool:
        return self.step_prefetch is not None

    def lookaheads(self) -> dict[tuple[int, int], list[list[tuple[int, int]]]]:
        """(step, records of the step before it) -> the lookahead prefetches issued there, in order."""
        out: dict = {}
        if self.la_step is None:
            return out
        for q in range(len(self.la_step)):
            keys = [(int(a), int(b)) for a, b in self.la_keys[self.la_start[q]:self.la_start[q + 1]]]
            out.setdefault((int(self.la_step[q]), int(self.la_rec[q])), []).append(keys)
        return out

    # -- views ---------------------------------------------------------------------
    @property
    def n_steps(self) -> int:
        return len(self.step_kind)

    @property
    def total_expert_bytes(self) -> int:
        return int(self.block_bytes.sum())

    def block_bytes_fn(self):
        table = self.block_bytes.tolist()
        return lambda layer, expert: table[layer][expert]

    def layer_block_sizes(self) -> list[list[int]]:
        return self.block_bytes.tolist()

    def steps(self) -> Iterator[TraceStep]:
        r = 0
        n_rec = len(self.rec_step)
        for s in range(self.n_steps):
            layers = []
            while r < n_rec and self.rec_step[r] == s:
                a, b = self.rec_start[r], self.rec_start[r + 1]
                layers.append((int(self.rec_layer[r]), self.experts[a:b], self.weights[a:b]))
                r += 1
            yield TraceStep(STEP_KINDS[self.step_kind[s]], int(self.step_tokens[s]), layers)

    # -- file ----------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        meta = json.dumps(self.meta.__dict__, sort_keys=True).encode()
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            np.savez_compressed(
                f, meta=np.frombuffer(meta, dtype=np.uint8), block_bytes=self.block_bytes,
                step_kind=self.step_kind, step_tokens=self.step_tokens, rec_step=self.rec_step,
                rec_layer=self.rec_layer, experts=self.experts, weights=self.weights,
                **{n: getattr(self, n) for n in LIVE_ARRAYS if getattr(self, n) is not None})
        os.replace(tmp, path)
        return path


def load_trace(path: str | os.PathLike) -> Trace:
    """Read and validate a trace file; FormatError with a plain message on anything wrong."""
    path = Path(path)
    if not path.is_file():
        raise FormatError(f"trace {path} does not exist")
    try:
        with np.load(path, allow_pickle=False) as z:
            missing = [name for name in ARRAYS if name not in z.files]
            if missing:
                raise FormatError(f"{path} is not a MawForge trace (missing {', '.join(missing)})")
            arrays = {name: z[name] for name in ARRAYS}
            arrays.update({name: z[name] for name in LIVE_ARRAYS if name in z.files})
    except FormatError:
        raise
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, KeyError) as e:
        raise FormatError(f"{path} is not a readable trace file ({type(e).__name__})") from None
    try:
        meta_dict = json.loads(arrays.pop("meta").tobytes().decode())
        meta = TraceMeta(**meta_dict)
    except (ValueError, TypeError, UnicodeDecodeError) as e:
        raise FormatError(f"{path} has unreadable trace metadata ({e})") from None
    return Trace(meta=meta, **arrays)


def _block_table(block_bytes, n_layers: int, n_experts: int) -> np.ndarray:
    """int, per-layer list, or [L, E] -> [L, E] int64."""
    table = np.asarray(block_bytes, dtype=np.int64)
    if table.ndim == 0:
        table = np.full((n_layers, n_experts), int(table), dtype=np.int64)
    elif table.ndim == 1:
        table = np.repeat(table[:, None], n_experts, axis=1)
    if table.shape != (n_layers, n_experts):
        raise FormatError(f"block sizes have shape {table.shape}, expected ({n_layers}, {n_experts})")
    return table


class TraceRecorder(CacheObserver):
    """Collects routing as the runtime runs. Pass the same arrays to the RouteDriver."""

    def __init__(self, *, n_layers: int, n_experts: int, top_k: int,
                 block_bytes: int | Sequence[int] | np.ndarray, model: str = "",
                 pack_digest: str = "", synthetic: bool = False,
                 synthetic_params: dict | None = None) -> None:
        self.meta = TraceMeta(n_layers=n_layers, n_experts=n_experts, top_k=top_k, model=model,
                              pack_digest=pack_digest, synthetic=synthetic,
                              synthetic_params=synthetic_params,
                              created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        self.block_bytes = _block_table(block_bytes, n_layers, n_experts)
        self._kinds: list[int] = []
        self._tokens: list[int] = []
        self._rec_step: list[int] = []
        self._rec_layer: list[int] = []
        self._experts: list[np.ndarray] = []
        self._weights: list[np.ndarray] = []
        self._dtype = np.int16 if n_experts <= np.iinfo(np.int16).max else np.int32
        self._prefetch: list[int] = []
        self._la: list[tuple[int, int, list]] = []     # (step, records of the step before, keys)
        self._step_recs = 0

    def begin_step(self, kind: str, n_tokens: int, prefetch: bool = True) -> None:
        if kind not in STEP_KINDS:
            raise ValueError(f"step kind must be one of {STEP_KINDS}, got {kind!r}")
        if n_tokens <= 0:
            raise ValueError(f"a step needs at least one token, got {n_tokens}")
        self._kinds.append(STEP_KINDS.index(kind))
        self._tokens.append(int(n_tokens))
        self._prefetch.append(int(bool(prefetch)))
        self._step_recs = 0

    def lookahead(self, keys) -> None:
        """A live lookahead prefetch of these (layer, expert) keys, issued now."""
        if not self._kinds:
            raise ValueError("lookahead() before begin_step()")
        self._la.append((len(self._kinds) - 1, self._step_recs, [(int(l), int(e)) for l, e in keys]))

    def record(self, layer: int, experts, weights) -> None:
        """experts: [T, k] int; weights: [T, k] float (normalized routing weights)."""
        if not self._kinds:
            raise ValueError("record() before begin_step()")
        e = np.asarray(experts).reshape(-1, self.meta.top_k).astype(self._dtype, copy=True)
        w = np.asarray(weights, dtype=np.float32).reshape(e.shape).copy()
        if e.shape[0] != self._tokens[-1]:
            raise ValueError(f"layer {layer} routed {e.shape[0]} tokens, step has {self._tokens[-1]}")
        self._rec_step.append(len(self._kinds) - 1)
        self._step_recs += 1
        self._rec_layer.append(int(layer))
        self._experts.append(e)
        self._weights.append(w)

    def set_live(self, capacity_bytes: int, policy: str, prefetch: str | None, stats) -> None:
        """Store the live cache's configuration and counters (CacheStats or its dict) so
        `mawforge replay` can check that replay reproduces them. The cache must have
        started empty when recording began, and served only the recorded steps."""
        d = stats if isinstance(stats, dict) else stats.to_dict()
        live = dict(capacity_bytes=int(capacity_bytes), policy=policy, prefetch=prefetch or "none")
        live.update({k: int(d[k]) for k in LIVE_COUNTERS})
        self.meta = replace(self.meta, live=live)

    def to_trace(self) -> Trace:
        k = self.meta.top_k
        return Trace(
            meta=self.meta, block_bytes=self.block_bytes,
            step_kind=np.asarray(self._kinds, dtype=np.uint8),
            step_tokens=np.asarray(self._tokens, dtype=np.int32),
            rec_step=np.asarray(self._rec_step, dtype=np.int32),
            rec_layer=np.asarray(self._rec_layer, dtype=np.int32),
            experts=np.concatenate(self._experts) if self._experts else np.zeros((0, k), self._dtype),
            weights=np.concatenate(self._weights) if self._weights else np.zeros((0, k), np.float32),
            step_prefetch=np.asarray(self._prefetch, dtype=np.uint8),
            la_step=np.asarray([s for s, _, _ in self._la], dtype=np.int32),
            la_rec=np.asarray([r for _, r, _ in self._la], dtype=np.int32),
            la_start=np.concatenate([[0], np.cumsum([len(k) for _, _, k in self._la])]).astype(np.int64),
            la_keys=np.asarray([key for _, _, ks in self._la for key in ks], dtype=np.int32).reshape(-1, 2))

    def save(self, path: str | os.PathLike) -> Path:
        return self.to_trace().save(path)
