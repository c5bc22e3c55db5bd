"""One normalized, frozen model config, built from GGUF metadata or an HF config.json.

Architecture names are llama.cpp's (`qwen3moe`, `qwen2moe`, `mixtral`, `olmoe`); HF
`model_type` values and the GGUF arch `llama` with experts map onto them.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from mawforge.errors import FormatError, UnsupportedError

SUPPORTED_ARCHS = ("qwen3moe", "qwen2moe", "mixtral", "olmoe")

HF_MODEL_TYPES = {
    "qwen3_moe": "qwen3moe",
    "qwen2_moe": "qwen2moe",
    "mixtral": "mixtral",
    "olmoe": "olmoe",
}

# Facts that the file formats do not carry, per architecture (from the transformers
# modeling files and llama.cpp's llama-model.cpp).
ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3moe": dict(qk_norm="head", norm_topk_prob=True, rope_layout="neox"),
    "qwen2moe": dict(qk_norm="none", norm_topk_prob=False, rope_layout="neox", qkv_bias=True),
    "mixtral": dict(qk_norm="none", norm_topk_prob=True, rope_layout="neox"),
    "olmoe": dict(qk_norm="full", norm_topk_prob=False, rope_layout="neox"),
}


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
        for f in ("n_layers", "hidden", "n_heads", "n_kv_heads", "head_dim", "vocab",
                  "n_experts", "top_k", "expert_ff"):
            if int(getattr(self, f)) <= 0:
                raise FormatError(f"model config: {f} must be positive, got {getattr(self, f)}")
        if self.top_k > self.n_experts:
            raise FormatError(f"model config: top_k {self.top_k} exceeds expert count {self.n_experts}")
        if self.n_heads % self.n_kv_heads:
            raise FormatError(f"model config: {self.n_heads} heads not divisible by {self.n_kv_heads} kv heads")
        if self.rope_layout not in ("neox", "norm"):
            raise FormatError(f"model config: rope_layout must be neox or norm, got {self.rope_layout!r}")
        if self.qk_norm not in ("none", "head", "full"):
            raise FormatError(f"model config: qk_norm must be none, head or full, got {self.qk_norm!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def from_gguf_metadata(meta: dict[str, Any], vocab: int) -> ModelConfig:
    """Normalize llama.cpp metadata keys ({arch}.block_count, ...) into a ModelConfig."""
    src_arch = meta.get("general.architecture")
    if src_arch is None:
        raise FormatError("GGUF has no general.architecture key")
    arch = src_arch
    if src_arch == "llama":
        if int(meta.get("llama.expert_count", 0) or 0) == 0:
            raise UnsupportedError(
                "GGUF arch 'llama' without experts is a dense model; "
                f"supported MoE architectures: {', '.join(SUPPORTED_ARCHS)}")
        arch = "mixtral"
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
    if src_arch == "llama":
        d["rope_layout"] = "norm"   # convert_hf_to_gguf permutes q/k rows for llama
    expert_ff = meta.get(f"{src_arch}.expert_feed_forward_length") or key("feed_forward_length")
    norm = meta.get(f"{src_arch}.expert_weights_norm")
    if norm is not None:
        d["norm_topk_prob"] = bool(norm)
    return ModelConfig(
        arch=arch,
        n_layers=int(key("block_count")),
        hidden=hidden,
        n_heads=n_heads,
        n_kv_heads=int(key("attention.head_count_kv", n_heads)),
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
        **d,
    )


def from_hf_config(cfg: dict[str, Any]) -> ModelConfig:
    """Normalize an HF config.json of a supported MoE model."""
    mt = cfg.get("model_type")
    if mt not in HF_MODEL_TYPES:
        raise UnsupportedError(
            f"unsupported model_type {mt!r}; supported: {', '.join(HF_MODEL_TYPES)}")
    arch = HF_MODEL_TYPES[mt]
    try:
        hidden = int(cfg["hidden_size"])
        n_heads = int(cfg["num_attention_heads"])
        n_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts"))
        expert_ff = int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
        d = dict(ARCH_DEFAULTS[arch])
        if "norm_topk_prob" in cfg:
            d["norm_topk_prob"] = bool(cfg["norm_topk_prob"])
        rope = cfg.get("rope_parameters") or {}
        rope_base = float(rope.get("rope_theta") or cfg.get("rope_theta") or 10000.0)
        return ModelConfig(
            arch=arch,
            n_layers=int(cfg["num_hidden_layers"]),
            hidden=hidden,
            n_heads=n_heads,
            n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
            head_dim=int(cfg.get("head_dim") or hidden // n_heads),
            vocab=int(cfg["vocab_size"]),
            n_experts=n_experts,
            top_k=int(cfg["num_experts_per_tok"]),
            expert_ff=expert_ff,
            shared_ff=int(cfg.get("shared_expert_intermediate_size") or 0),
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_base=rope_base,
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            context_length=int(cfg.get("max_position_embeddings", 4096)),
            **d,
        )
    except (KeyError, TypeError, ValueError) as e:
        raise FormatError(f"config.json for {mt} is missing or has a bad value: {e}") from None
