"""One normalized, frozen model config, built from GGUF metadata or an HF config.json.

Architecture names are llama.cpp's (`qwen3moe`, `qwen2moe`, `mixtral`, `olmoe`, ...); HF
`model_type` values and GGUF aliases (arch `llama` with experts) map onto them. The family
settings of each architecture are its file's business (mawforge/archs/<name>.py): its readers
fill `extra` (plain JSON, stored in the manifest) and `cfg.args` is the typed view of it.
"""
from __future__ import annotations

import contextlib
import math
import numbers
import functools
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from mawforge.archs import ARCHS, GGUF_ALIASES, HF_MODEL_TYPES
from mawforge.errors import FormatError, UnsupportedError

# Derived from the architecture files (mawforge/archs/): one file per architecture declares its
# names, HF model types, the facts the formats do not carry (defaults) and its readers.
SUPPORTED_ARCHS = tuple(ARCHS)
ARCH_DEFAULTS: dict[str, dict[str, Any]] = {name: dict(a.defaults) for name, a in ARCHS.items()}


# Upper bounds far above any real checkpoint: a damaged or hostile file must not make the
# readers build per-layer lists or per-expert tables of absurd length.
LIMITS = {"n_layers": 1 << 12, "hidden": 1 << 20, "n_heads": 1 << 14, "n_kv_heads": 1 << 14,
          "head_dim": 1 << 16, "vocab": 1 << 24, "n_experts": 1 << 16, "top_k": 1 << 16,
          "expert_ff": 1 << 22, "shared_ff": 1 << 26, "context_length": 1 << 28}
_BAD_VALUE = (KeyError, TypeError, ValueError, OverflowError, IndexError, ZeroDivisionError, AttributeError,
              RecursionError)


class Tracked(dict):
    """A config mapping that remembers the last key read, so that a conversion failing right
    after (int("abc"), float([])) is reported with the key that held the bad value."""
    last: str | None = None

    def __getitem__(self, k):
        self.last = k
        return super().__getitem__(k)

    def get(self, k, default=None):
        self.last = k
        return super().get(k, default)


@contextlib.contextmanager
def bad_values(where: str, cfg: dict | None = None):
    """Turns a wrong type or missing key met while converting a config into one FormatError."""
    try:
        yield
    except _BAD_VALUE as e:
        key = getattr(cfg, "last", None)
        if isinstance(e, KeyError):
            raise FormatError(f"{where}: missing key {e}") from None
        shown = f" {key} = {repr(dict.get(cfg, key))[:60]}" if key is not None else ""
        raise FormatError(f"{where}:{shown} is a bad value ({type(e).__name__}: {str(e)[:120]})") from None


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _layer_count(v, where: str) -> None:
    """Checked before the family readers build per-layer lists from it."""
    if not _is_int(v) or not 0 < v <= LIMITS["n_layers"]:
        raise FormatError(f"{where}: layer count must be an integer in 1..{LIMITS['n_layers']}, got {v!r}")


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab: int
    n_experts: int
    top_k: int
    expert_ff: int
    shared_ff: int = 0          # qwen2moe shared expert (0: none)
    norm_eps: float = 1e-6
    rope_base: float = 10000.0
    rope_layout: str = "neox"   # "neox" (rotate halves) or "norm" (interleaved pairs, GGUF llama)
    qk_norm: str = "none"       # "none", "head" (per head, qwen3) or "full" (whole projection, olmoe)
    qkv_bias: bool = False
    norm_topk_prob: bool = True
    tie_embeddings: bool = False
    context_length: int = 4096
    # Family-specific settings (layer types, sliding windows, MLA ranks, ...): plain JSON
    # values, read by that family's model file and its KV accounting.
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHS:
            raise UnsupportedError(
                f"unsupported architecture {self.arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}")
        for f, hi in LIMITS.items():
            v = getattr(self, f)
            lo = 0 if f == "shared_ff" else 1
            if not _is_int(v) or not lo <= v <= hi:
                raise FormatError(f"model config: {f} must be an integer in {lo}..{hi}, got {v!r}")
        for f in ("norm_eps", "rope_base"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or v < 0:
                raise FormatError(f"model config: {f} must be a finite non-negative number, got {v!r}")
        for f in ("qkv_bias", "norm_topk_prob", "tie_embeddings"):
            if not isinstance(getattr(self, f), bool):
                raise FormatError(f"model config: {f} must be true or false, got {getattr(self, f)!r}")
        if not isinstance(self.extra, dict):
            raise FormatError(f"model config: extra must be an object, got {type(self.extra).__name__}")
        if self.top_k > self.n_experts:
            raise FormatError(f"model config: top_k {self.top_k} exceeds expert count {self.n_experts}")
        if self.n_heads % self.n_kv_heads:
            raise FormatError(f"model config: {self.n_heads} heads not divisible by {self.n_kv_heads} kv heads")
        if self.rope_layout not in ("neox", "norm"):
            raise FormatError(f"model config: rope_layout must be neox or norm, got {self.rope_layout!r}")
        if self.qk_norm not in ("none", "head", "full"):
            raise FormatError(f"model config: qk_norm must be none, head or full, got {self.qk_norm!r}")

    @functools.cached_property
    def args(self):
        """The architecture's typed settings (its file's Args), parsed once from `extra`."""
        return ARCHS[self.arch].args.from_extra(self.extra)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        if not isinstance(d, dict):
            raise FormatError(f"model config must be an object, got {type(d).__name__}")
        names = {f.name for f in fields(cls)}
        with bad_values("model config"):
            return cls(**{k: v for k, v in d.items() if k in names})


def from_gguf_metadata(meta: dict[str, Any], vocab: int) -> ModelConfig:
    """Normalize llama.cpp metadata keys ({arch}.block_count, ...) into a ModelConfig.
    A value of the wrong type (a string, an array, NaN where a count belongs) is a FormatError."""
    src_arch = meta.get("general.architecture")
    if src_arch is None:
        raise FormatError("GGUF has no general.architecture key")
    if not isinstance(src_arch, str):
        raise FormatError(f"GGUF general.architecture must be a string, got {type(src_arch).__name__}")
    for k, v in meta.items():
        if k.startswith(src_arch + ".") and isinstance(v, float) and not math.isfinite(v):
            raise FormatError(f"GGUF metadata {k} is {v}")
    _layer_count(meta.get(f"{src_arch}.block_count"), f"GGUF {src_arch}.block_count")
    meta = Tracked(meta)
    with bad_values("GGUF metadata", meta):
        return _from_gguf(meta, vocab, src_arch)


def _from_gguf(meta: dict[str, Any], vocab: int, src_arch: str) -> ModelConfig:
    arch = GGUF_ALIASES.get(src_arch, src_arch)
    if arch != src_arch and int(meta.get(f"{src_arch}.expert_count", 0) or 0) == 0:
        raise UnsupportedError(
            f"GGUF arch {src_arch!r} without experts is a dense model; "
            f"supported MoE architectures: {', '.join(SUPPORTED_ARCHS)}")
    if arch not in SUPPORTED_ARCHS:
        raise UnsupportedError(
            f"unsupported architecture {src_arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}")

    def key(name: str, default: Any = None) -> Any:
        v = meta.get(f"{src_arch}.{name}", default)
        if v is None:
            raise FormatError(f"GGUF is missing metadata key {src_arch}.{name}")
        return v

    hidden = int(key("embedding_length"))
    n_heads = int(key("attention.head_count"))
    d = dict(ARCH_DEFAULTS[arch])
    expert_ff = meta.get(f"{src_arch}.expert_feed_forward_length") or key("feed_forward_length")
    norm = meta.get(f"{src_arch}.expert_weights_norm")
    if norm is not None:
        d["norm_topk_prob"] = bool(norm)
    kv = meta.get(f"{src_arch}.attention.head_count_kv", n_heads)
    return ModelConfig(**(dict(
        arch=arch,
        n_layers=int(key("block_count")) - int(meta.get(f"{src_arch}.nextn_predict_layers", 0) or 0),
        hidden=hidden,
        n_heads=n_heads,
        n_kv_heads=int(kv[0] if isinstance(kv, list) else kv),
        head_dim=int(meta.get(f"{src_arch}.attention.key_length") or hidden // n_heads),
        vocab=vocab,
        n_experts=int(key("expert_count")),
        top_k=int(key("expert_used_count")),
        expert_ff=int(expert_ff),
        shared_ff=int(meta.get(f"{src_arch}.expert_shared_feed_forward_length", 0) or 0),
        norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_base=float(key("rope.freq_base", 10000.0)),
        context_length=int(key("context_length", 4096)),
        tie_embeddings=False,  # decided by the reader from the tensor table
        **d) | ARCHS[arch].read_gguf(meta)))


def from_hf_config(cfg: dict[str, Any]) -> ModelConfig:
    """Normalize an HF config.json of a supported MoE model."""
    if not isinstance(cfg, dict):
        raise FormatError(f"config.json must be a JSON object, got {type(cfg).__name__}")
    mt = cfg.get("model_type")
    if not isinstance(mt, str) or mt not in HF_MODEL_TYPES:
        raise UnsupportedError(
            f"unsupported model_type {mt!r}; supported: {', '.join(HF_MODEL_TYPES)}")
    arch = HF_MODEL_TYPES[mt]
    if isinstance(cfg.get("text_config"), dict):     # multimodal checkpoints nest the text model
        cfg = {**cfg["text_config"], "model_type": mt}
    _layer_count(cfg.get("num_hidden_layers"), "config.json num_hidden_layers")
    cfg = Tracked(cfg)
    with bad_values(f"config.json ({mt})", cfg):
        return _from_hf(cfg, mt, arch)


def _from_hf(cfg: dict, mt: str, arch: str) -> ModelConfig:
    hidden = int(cfg["hidden_size"])
    n_heads = int(cfg["num_attention_heads"])
    n_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts"))
    top_k = int(cfg.get("num_experts_per_tok") or cfg["top_k_experts"])
    expert_ff = int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
    d = dict(ARCH_DEFAULTS[arch])
    if "norm_topk_prob" in cfg:
        d["norm_topk_prob"] = bool(cfg["norm_topk_prob"])
    rope = cfg.get("rope_parameters") or {}
    rope_base = float(rope.get("rope_theta") or cfg.get("rope_theta") or 10000.0)
    return ModelConfig(**(dict(
        arch=arch,
        n_layers=int(cfg["num_hidden_layers"]),
        hidden=hidden,
        n_heads=n_heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
        head_dim=int(cfg.get("head_dim") or hidden // n_heads),
        vocab=int(cfg["vocab_size"]),
        n_experts=n_experts,
        top_k=top_k,
        expert_ff=expert_ff,
        shared_ff=int(cfg.get("shared_expert_intermediate_size") or 0),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_base=rope_base,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        context_length=int(cfg.get("max_position_embeddings", 4096)),
        **d) | ARCHS[arch].read_hf(cfg)))
