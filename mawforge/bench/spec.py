"""The matrix file (YAML) and its expansion: models x cache points x contexts x prompt classes x
repetitions for MawForge, plus baseline engines x contexts x classes x repetitions.

    name: smoke                      # example: examples/matrix.yaml
    budget_gib: 18
    contexts: [4096, 32768]
    cache_points: [15, 25, 35, 50, 65]       # default; a model may give its own
    prompt_classes: [code, summarization, writing, reasoning]
    repetitions: 5
    max_tokens: 96
    seed: 0
    models:
      - id: qwen3-q4
        pack: packs/qwen3-q4                 # paths are relative to this file
        cache_points: [15, 25, 35, 65, 90]
        baselines:
          - {engine: llama_cpp, source: models/qwen3-q4.gguf}
          - {engine: transformers, source: models/qwen3-hf}
A cell is one (model, engine, context, cache point): one server process serves all its rows.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import yaml

from mawforge.bench.prompts import CLASSES
from mawforge.errors import FormatError

ENGINES = ("mawforge", "llama_cpp", "llama_cpp_nommap", "transformers")
BASELINE_ENGINES = ENGINES[1:]


def _safe(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", s)


@dataclass(frozen=True)
class Baseline:
    engine: str
    source: str

    def __post_init__(self) -> None:
        if self.engine not in BASELINE_ENGINES:
            raise FormatError(f"unknown baseline engine {self.engine!r}; known: {', '.join(BASELINE_ENGINES)}")


@dataclass(frozen=True)
class ModelSpec:
    id: str
    pack: str | None
    cache_points: tuple[float, ...]
    baselines: tuple[Baseline, ...] = ()

    def __post_init__(self) -> None:
        if not self.id or _safe(self.id) != self.id:
            raise FormatError(f"model id {self.id!r} must be non-empty letters, digits, '.', '_' or '-'")
        if self.pack is None and not self.baselines:
            raise FormatError(f"model {self.id!r} has neither a pack nor baselines")
        if self.pack is not None and not self.cache_points:
            raise FormatError(f"model {self.id!r} has a pack but no cache points")
        if any(not 0 < p <= 100 for p in self.cache_points):
            raise FormatError(f"model {self.id!r}: cache points must be percents in (0, 100]")


@dataclass(frozen=True)
class GuardSpec:
    system_used: float | None = 0.98
    tree_rss_gib: float | None = None
    cgroup_used: float | None = None


@dataclass(frozen=True)
class MatrixSpec:
    name: str
    models: tuple[ModelSpec, ...]
    budget_gib: float | None
    contexts: tuple[int, ...]
    prompt_classes: tuple[str, ...] = CLASSES
    repetitions: int = 5
    max_tokens: int = 96
    seed: int = 0
    ignore_eos: bool = True
    threads: int | None = None
    serve_args: tuple[str, ...] = ()
    memory_limit_gib: float | None = None
    request_timeout_s: float = 600.0
    start_timeout_s: float = 300.0
    guard: GuardSpec = field(default_factory=GuardSpec)

    def __post_init__(self) -> None:
        if not self.models:
            raise FormatError("the matrix names no models")
        ids = [m.id for m in self.models]
        if len(set(ids)) != len(ids):
            raise FormatError(f"model ids repeat: {ids}")
        if not self.contexts or any(c < 1 for c in self.contexts):
            raise FormatError("contexts must be a non-empty list of positive token counts")
        bad = [c for c in self.prompt_classes if c not in CLASSES]
        if bad or not self.prompt_classes:
            raise FormatError(f"unknown prompt classes {bad}; known: {', '.join(CLASSES)}")
        if self.repetitions < 1 or self.max_tokens < 1:
            raise FormatError("repetitions and max_tokens must be at least 1")

    @classmethod
    def load(cls, path: str | Path) -> "MatrixSpec":
        path = Path(path)
        try:
            d = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError) as e:
            raise FormatError(f"cannot read the matrix file {path}: {e}") from None
        return cls.from_dict(d, base=path.parent)

    @classmethod
    def from_dict(cls, d: dict, base: Path = Path(".")) -> "MatrixSpec":
        if not isinstance(d, dict):
            raise FormatError("the matrix file must be a YAML mapping")
        known = {f.name for f in fields(cls)} | {"cache_points"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise FormatError(f"unknown matrix keys: {', '.join(unknown)}")
        resolve = lambda p: str((base / p).resolve()) if p is not None else None
        default_cache = tuple(float(p) for p in d.get("cache_points", ()))
        models = []
        for m in d.get("models") or ():
            bl = tuple(Baseline(b["engine"], resolve(b["source"])) for b in m.get("baselines") or ())
            cps = tuple(float(p) for p in m.get("cache_points", default_cache))
            models.append(ModelSpec(str(m.get("id", "")), resolve(m.get("pack")), cps, bl))
        kw = {k: v for k, v in d.items() if k not in ("models", "cache_points", "guard")}
        for k in ("contexts", "prompt_classes", "serve_args"):
            if k in kw:
                kw[k] = tuple(kw[k])
        return cls(models=tuple(models), guard=GuardSpec(**(d.get("guard") or {})), **kw)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Row:
    model: str
    engine: str
    context: int
    cache_percent: float | None          # None for baselines (no expert cache)
    prompt_class: str
    repetition: int

    @property
    def cell_id(self) -> str:
        cache = "full" if self.cache_percent is None else f"p{self.cache_percent:g}"
        return _safe(f"{self.model}.{self.engine}.n{self.context}.{cache}")

    @property
    def row_id(self) -> str:
        return f"{self.cell_id}.{self.prompt_class}.r{self.repetition}"

    def to_dict(self) -> dict:
        return asdict(self) | {"row_id": self.row_id, "cell_id": self.cell_id}


def expand(spec: MatrixSpec) -> list[Row]:
    """Every row of the matrix, rejected cells included (rejection is a row's result)."""
    rows = []
    for m in spec.models:
        cells = [("mawforge", n, p) for n in spec.contexts for p in m.cache_points] if m.pack else []
        cells += [(b.engine, n, None) for b in m.baselines for n in spec.contexts]
        for engine, n, p in cells:
            rows += [Row(m.id, engine, n, p, c, r) for c in spec.prompt_classes for r in range(spec.repetitions)]
    return rows


def model(spec: MatrixSpec, model_id: str) -> ModelSpec:
    return next(m for m in spec.models if m.id == model_id)


def source_for(spec: MatrixSpec, row: Row) -> str:
    m = model(spec, row.model)
    if row.engine == "mawforge":
        return m.pack
    return next(b.source for b in m.baselines if b.engine == row.engine)
