"""What one architecture declares: `ARCH = Arch(...)`. Torch-free, so the readers and the
planner can read every architecture's facts without loading the model code.

An architecture is a package, mawforge/archs/<name>/ (as transformers' configuration_x.py +
modeling_x.py). Its `__init__.py` holds the torch-free facts, in this order: its typed `Args`
(the family settings a ModelConfig keeps as plain JSON in `extra`, parsed once into a frozen
dataclass), its HF config.json and GGUF metadata readers, its HF tensor-name table, the common
tensors it keeps dense and the ones it requires, and `ARCH`. Its `model.py` holds the model
class at module level: the only module of the architecture that imports torch and
mawforge.models (tests/test_layers.py ranks `mawforge.archs.*.model` as model code, the rest
as formats code). `ARCH.model` names that class ("module:Class"); `model_class()` imports it
on first use.
"""
from __future__ import annotations

import dataclasses
import importlib
import re
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

from mawforge.errors import FormatError


@dataclass(frozen=True)
class ArchArgs:
    """Typed family settings. A subclass lists its fields; `from_extra` reads them from a
    ModelConfig's `extra` (the manifest's JSON). Shared: `kv_layers` (what each layer keeps
    between steps, read by the planner and models/kv.py), `layer_types` (per layer, e.g.
    "full", "sliding", "linear"; empty when every layer is alike), `dense_layers` (layers with a
    dense MLP and no routed experts) and `mtp_layers` (MTP / nextn blocks after the last layer)."""
    kv_layers: tuple = ()
    layer_types: tuple = ()
    dense_layers: tuple = ()
    mtp_layers: int = 0

    def full_layers(self) -> list[bool]:
        """Per layer: does it run full (global) attention?"""
        return [t == "full" for t in self.layer_types]

    @classmethod
    def from_extra(cls, extra: dict) -> "ArchArgs":
        names = {f.name for f in dataclasses.fields(cls)}
        try:
            return cls(**{k: _frozen(v) for k, v in extra.items() if k in names})
        except TypeError as e:
            raise FormatError(f"model config extra: {e}") from None


def _frozen(v: Any) -> Any:
    """JSON lists become tuples so that Args stay hashable and cannot be edited in place."""
    return tuple(_frozen(x) for x in v) if isinstance(v, list) else v


def nextn_names(eh_proj: str, enorm: str, hnorm: str, head_norm: str) -> tuple:
    """HF names (regex tails after layers.N.) of an MTP block stored as layer n_layers ->
    llama.cpp's blk.N.nextn.* names."""
    canon = ("eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head_norm.weight")
    return tuple((r"layers\.(\d+)\." + hf, "blk.{0}.nextn." + c)
                 for hf, c in zip((eh_proj, enorm, hnorm, head_norm), canon))


def no_settings(cfg: dict) -> dict:
    return {}


def no_required(cfg, layer: int) -> tuple:
    return ()


@dataclass(frozen=True)
class Arch:
    name: str                                   # llama.cpp's architecture name (GGUF general.architecture)
    hf_model_types: tuple[str, ...]             # HF config.json model_type values that map here
    model: str                                  # "package.model:Class", imported by model_class()
    defaults: dict = field(default_factory=dict)    # ModelConfig fields the file formats do not carry
    args: type = ArchArgs                       # typed view of ModelConfig.extra
    read_hf: Callable[[dict], dict] = no_settings   # config.json -> ModelConfig field overrides (extra too)
    read_gguf: Callable[[dict], dict] = no_settings  # GGUF metadata -> the same
    gguf_aliases: tuple[str, ...] = ()          # other general.architecture values read as this arch
    hf_names: tuple = ()                        # (HF regex after "model.", canonical template), tried first
    hf_expert_kinds: dict = field(default_factory=dict)  # HF expert kind -> stored kind (layout differs)
    dense: tuple[str, ...] = ()                 # common-tensor suffixes kept float32 (byte_rules adds them)
    required: Callable[[Any, int], tuple] = no_required   # (cfg, layer) -> blk.N. suffixes the model reads
    order: int = 100                            # position in SUPPORTED_ARCHS (error messages, docs)

    compiled: ClassVar[dict] = {}

    @property
    def package(self) -> str:
        """The package's name under mawforge/archs/ (its fixture module has the same name)."""
        return self.model.partition(":")[0].split(".")[-2]

    def model_class(self) -> type:
        """The model class, imported on first use (its module imports torch; these facts do not)."""
        module, _, name = self.model.partition(":")
        return getattr(importlib.import_module(module), name)

    def hf_name_table(self) -> list:
        if self.name not in Arch.compiled:
            Arch.compiled[self.name] = [(re.compile(p + r"$"), t) for p, t in self.hf_names]
        return Arch.compiled[self.name]
