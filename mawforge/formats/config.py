"""One normalized, frozen model config, built from GGUF metadata or an HF config.json.

Architecture names are llama.cpp's (`qwen3moe`, `qwen2moe`, `mixtral`, `olmoe`); HF
`model_type` values and the GGUF arch `llama` with experts map onto them.
"""
from __future__ import annotations

import contextlib
import math
import numbers
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from mawforge.errors import FormatError, UnsupportedError

SUPPORTED_ARCHS = ("qwen3moe", "qwen2moe", "mixtral", "olmoe", "qwen35moe", "gemma4", "deepseek2", "gpt-oss",
                   "qwen3next")

HF_MODEL_TYPES = {
    "qwen3_moe": "qwen3moe",
    "qwen2_moe": "qwen2moe",
    "mixtral": "mixtral",
    "olmoe": "olmoe",
    "qwen3_5_moe": "qwen35moe", "qwen3_5_moe_text": "qwen35moe",
    "gemma4": "gemma4", "gemma4_text": "gemma4",
    "deepseek_v3": "deepseek2", "deepseek_v2": "deepseek2", "gpt_oss": "gpt-oss",
    "qwen3_next": "qwen3next",
}

# Facts that the file formats do not carry, per architecture (from the transformers
# modeling files and llama.cpp's llama-model.cpp).
ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3moe": dict(qk_norm="head", norm_topk_prob=True, rope_layout="neox"),
    "qwen2moe": dict(qk_norm="none", norm_topk_prob=False, rope_layout="neox", qkv_bias=True),
    "mixtral": dict(qk_norm="none", norm_topk_prob=True, rope_layout="neox"),
    "olmoe": dict(qk_norm="full", norm_topk_prob=False, rope_layout="neox"),
    "qwen35moe": dict(qk_norm="head", norm_topk_prob=True, rope_layout="neox"),
    "gemma4": dict(qk_norm="head", norm_topk_prob=True, rope_layout="neox"),
    "deepseek2": dict(qk_norm="none", rope_layout="norm"),   # interleaved-pair RoPE on the rope part
    "gpt-oss": dict(qk_norm="none", norm_topk_prob=True, rope_layout="neox", qkv_bias=True),
    "qwen3next": dict(qk_norm="head", norm_topk_prob=True, rope_layout="neox"),
}


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
        **d) | _family_gguf(arch, meta)))


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
        **d) | _family_hf(arch, cfg)))


# ---- family settings (config.extra), torch-free: the planner and the KV cache read them ----
# extra["kv_layers"] lists, per layer, what it keeps between steps: {"kind": "kv", "kv_heads",
# "head_dim"[, "window"]} grows with the context; {"kind": "recurrent", "state": [shapes]} is fixed.

def _qwen35_extra(n_layers: int, full: list[bool], *, kv_heads: int, head_dim: int, rope_dim: int,
                  nk: int, nv: int, dk: int, dv: int, conv: int, norm_offset: float, v_heads: str,
                  mtp: int) -> dict:
    conv_dim = 2 * nk * dk + nv * dv
    kv = [{"kind": "kv", "kv_heads": kv_heads, "head_dim": head_dim} if f else
          {"kind": "recurrent", "state": [[conv_dim, conv - 1], [nv, dk, dv]]} for f in full]
    if len(kv) != n_layers or nv % nk:
        raise FormatError(f"qwen35moe: {len(kv)} layer types for {n_layers} layers, {nv} value heads "
                          f"for {nk} key heads")
    return {"extra": {"layer_types": ["full" if f else "linear" for f in full], "rope_dim": rope_dim,
                      "linear": {"k_heads": nk, "v_heads": nv, "k_dim": dk, "v_dim": dv, "conv": conv,
                                 "v_order": v_heads},
                      "norm_offset": norm_offset, "mtp_layers": mtp, "kv_layers": kv}}


def _qwen35moe_hf(c: dict) -> dict:
    n, hd = int(c["num_hidden_layers"]), int(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])
    rope = c.get("rope_parameters") or {}
    prf = float(rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 0.25)))
    types = c.get("layer_types") or ["full_attention" if (i + 1) % int(c.get("full_attention_interval", 4)) == 0
                                     else "linear_attention" for i in range(n)]
    return _qwen35_extra(n, [t == "full_attention" for t in types], kv_heads=int(c["num_key_value_heads"]),
                         head_dim=hd, rope_dim=int(hd * prf), nk=int(c["linear_num_key_heads"]),
                         nv=int(c["linear_num_value_heads"]), dk=int(c["linear_key_head_dim"]),
                         dv=int(c["linear_value_head_dim"]), conv=int(c["linear_conv_kernel_dim"]),
                         norm_offset=1.0, v_heads="grouped", mtp=int(c.get("mtp_num_hidden_layers", 0) or 0))


def _qwen35moe_gguf(m: dict) -> dict:
    a = "qwen35moe."
    n = int(m[a + "block_count"]) - int(m.get(a + "nextn_predict_layers", 0) or 0)
    every = int(m.get(a + "full_attention_interval", 4))
    nv, ds = int(m[a + "ssm.time_step_rank"]), int(m[a + "ssm.state_size"])
    hd = int(m.get(a + "attention.key_length") or m[a + "embedding_length"] // m[a + "attention.head_count"])
    return _qwen35_extra(n, [(i + 1) % every == 0 for i in range(n)], kv_heads=int(m[a + "attention.head_count_kv"]),
                         head_dim=hd, rope_dim=int(m.get(a + "rope.dimension_count", hd)),
                         nk=int(m[a + "ssm.group_count"]), nv=nv, dk=ds, dv=int(m[a + "ssm.inner_size"]) // nv,
                         conv=int(m[a + "ssm.conv_kernel"]), norm_offset=0.0, v_heads="tiled",
                         mtp=int(m.get(a + "nextn_predict_layers", 0) or 0))


def _gemma4_extra(full: list[bool], *, heads: int, kv_s: int, kv_f: int, d_s: int, d_f: int, window: int,
                  theta_s: float, theta_f: float, pairs_f: int, softcap, k_eq_v: bool) -> dict:
    if heads % kv_f:
        raise FormatError(f"gemma4: {heads} heads not divisible by {kv_f} global kv heads")
    kv = [{"kind": "kv", "kv_heads": kv_f, "head_dim": d_f} if f else
          {"kind": "kv", "kv_heads": kv_s, "head_dim": d_s, "window": window} for f in full]
    return {"rope_base": theta_s, "extra": {
        "layer_types": ["full" if f else "sliding" for f in full], "sliding_window": window,
        "full": {"kv_heads": kv_f, "head_dim": d_f, "rope_base": theta_f, "rope_pairs": pairs_f, "k_eq_v": k_eq_v},
        "final_logit_softcapping": softcap, "kv_layers": kv}}


def _gemma4_hf(c: dict) -> dict:
    if int(c.get("hidden_size_per_layer_input") or 0) or int(c.get("num_kv_shared_layers") or 0):
        raise UnsupportedError("gemma4 with per-layer embeddings or shared KV layers (the dense E2B/E4B "
                               "models) is not supported; the MoE models have neither")
    n, d_s = int(c["num_hidden_layers"]), int(c["head_dim"])
    full = [t == "full_attention" for t in c["layer_types"]]
    plc = {int(k): v for k, v in (c.get("per_layer_config") or {}).items()}
    g = next((plc[i] for i in range(n) if full[i] and i in plc), {})
    d_f = int(g.get("head_dim") or c.get("global_head_dim") or d_s)
    kv_f = int(g.get("num_key_value_heads") or c.get("num_global_key_value_heads") or c["num_key_value_heads"])
    rp = c.get("rope_parameters") or {}
    rs, rf = rp.get("sliding_attention") or {}, rp.get("full_attention") or {}
    pairs = int(float(rf.get("partial_rotary_factor", 1.0)) * d_f // 2) if rf.get("rope_type") == "proportional" \
        else int(d_f * float(rf.get("partial_rotary_factor", 1.0))) // 2
    return _gemma4_extra(full, heads=int(c["num_attention_heads"]), kv_s=int(c["num_key_value_heads"]), kv_f=kv_f,
                         d_s=d_s, d_f=d_f, window=int(c["sliding_window"]), theta_s=float(rs.get("rope_theta", 10000.0)),
                         theta_f=float(rf.get("rope_theta", 1e6)), pairs_f=pairs,
                         softcap=c.get("final_logit_softcapping"), k_eq_v=bool(c.get("attention_k_eq_v")))


def _gemma4_gguf(m: dict) -> dict:
    a = "gemma4."
    n = int(m[a + "block_count"])
    swa = m.get(a + "attention.sliding_window_pattern")
    full = [not bool(x) for x in swa] if isinstance(swa, list) else [(i + 1) % 6 == 0 for i in range(n)]
    kv = m[a + "attention.head_count_kv"]
    kvs = kv if isinstance(kv, list) else [kv] * n
    d_f, d_s = int(m[a + "attention.key_length"]), int(m[a + "attention.key_length_swa"])
    i_f, i_s = full.index(True), full.index(False)
    return _gemma4_extra(full, heads=int(m[a + "attention.head_count"]), kv_s=int(kvs[i_s]), kv_f=int(kvs[i_f]),
                         d_s=d_s, d_f=d_f, window=int(m[a + "attention.sliding_window"]),
                         theta_s=float(m.get(a + "rope.freq_base_swa", 10000.0)),
                         theta_f=float(m.get(a + "rope.freq_base", 1e6)), pairs_f=d_f // 2,
                         softcap=m.get(a + "final_logit_softcapping"), k_eq_v=False) | {
        "n_kv_heads": int(kvs[i_s]), "head_dim": d_s}


def _qwen3next_hf(c: dict) -> dict:
    """As Qwen3.5 (zero-centred norms, grouped value heads, one MTP block); every layer must be MoE, as in the
    released checkpoints and as llama.cpp requires (it has no dense-layer path for this arch)."""
    step, dense = int(c.get("decoder_sparse_step") or 1), list(c.get("mlp_only_layers") or [])
    if dense or step != 1:
        raise UnsupportedError(f"qwen3_next with dense MLP layers (mlp_only_layers {dense}, decoder_sparse_step "
                               f"{step}) is not supported; the released models are MoE in every layer")
    # config.json does not count the MTP block (llama.cpp's converter counts mtp.layers.*); the
    # released models have one, and the model file drafts with it only where its tensors are
    return _qwen35moe_hf({**c, "mtp_num_hidden_layers": c.get("mtp_num_hidden_layers") or 1})


def _qwen3next_gguf(m: dict) -> dict:
    """llama.cpp's qwen3next keys; recurrent layers from attention.recurrent_layers when the
    converter wrote it, else every full_attention_interval-th layer is full attention."""
    a = "qwen3next."
    mtp = int(m.get(a + "nextn_predict_layers", 0) or 0)
    n = int(m[a + "block_count"]) - mtp
    rec = m.get(a + "attention.recurrent_layers")
    every = int(m.get(a + "full_attention_interval", 4))
    full = [not bool(x) for x in rec[:n]] if isinstance(rec, list) else [(i + 1) % every == 0 for i in range(n)]
    nv, ds = int(m[a + "ssm.time_step_rank"]), int(m[a + "ssm.state_size"])
    hd = int(m.get(a + "attention.key_length") or m[a + "embedding_length"] // m[a + "attention.head_count"])
    return _qwen35_extra(n, full, kv_heads=int(m[a + "attention.head_count_kv"]), head_dim=hd,
                         rope_dim=int(m.get(a + "rope.dimension_count", hd)), nk=int(m[a + "ssm.group_count"]),
                         nv=nv, dk=ds, dv=int(m[a + "ssm.inner_size"]) // nv, conv=int(m[a + "ssm.conv_kernel"]),
                         norm_offset=0.0, v_heads="grouped", mtp=mtp)


_FAMILY_HF = {"qwen35moe": _qwen35moe_hf, "gemma4": _gemma4_hf, "qwen3next": _qwen3next_hf}
_FAMILY_GGUF = {"qwen35moe": _qwen35moe_gguf, "gemma4": _gemma4_gguf, "qwen3next": _qwen3next_gguf}

from mawforge.formats import families_ds_oss as _ds_oss  # noqa: E402  (DeepSeek V2/V3, GPT-OSS)

_FAMILY_HF.update(deepseek2=_ds_oss.deepseek2_hf, **{"gpt-oss": _ds_oss.gptoss_hf})
_FAMILY_GGUF.update(deepseek2=_ds_oss.deepseek2_gguf, **{"gpt-oss": _ds_oss.gptoss_gguf})


def _family_hf(arch: str, cfg: dict) -> dict:
    return _FAMILY_HF[arch](cfg) if arch in _FAMILY_HF else {}


def _family_gguf(arch: str, meta: dict) -> dict:
    return _FAMILY_GGUF[arch](meta) if arch in _FAMILY_GGUF else {}
