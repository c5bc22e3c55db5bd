"""`mawforge synth --shape gpt-oss`: a shape-true gpt-oss GGUF (llama.cpp arch `gpt-oss`), written
as a shard set the way the hubs ship gpt-oss-120b (`name-00001-of-0000N.gguf`).

gpt-oss-120b's dimensions by default (36 layers, hidden 2880, 64 query heads and 8 KV heads of 64,
128 experts of width 2880, top-4, attention sinks, a 128-token sliding window on every other layer,
YaRN to 131072, vocab 201088) and the quant mix of its MXFP4 GGUF: MXFP4 experts, Q8_0 attention,
embeddings and head, F32 norms, biases, sinks and router. Every quantized tensor is random valid
blocks, streamed tensor by tensor, so the ~61 GB set costs the disk write and a few chunks of memory.

Routing: the router input is RMS-normalized, so router rows of std 1/sqrt(hidden) give unit-std
logits; each layer's router bias is fitted (synth/routing.fit_biases) so that top-k inclusion
follows a Zipf law of exponent `skew` over a random permutation of the experts. There is no
calibration forward (the Qwen3 shape's stickiness): a token's experts follow its own hidden state,
which the residual stream keeps close to its embedding.
"""
from __future__ import annotations

import math
import os
import shutil
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from mawforge.errors import FormatError, PackExists
from mawforge.synth.blocks import Blocks
from mawforge.synth.routing import fit_biases, zipf_inclusion

PROJ_STD = 0.02
CHUNK_BYTES = 32 << 20
ARCH = "gpt-oss"


@dataclass(frozen=True)
class OssSpec:
    layers: int = 36
    seed: int = 0
    skew: float = 1.0
    vocab: int = 201088
    hidden: int = 2880
    n_head: int = 64
    n_head_kv: int = 8
    head_dim: int = 64
    n_expert: int = 128
    n_expert_used: int = 4
    expert_ff: int = 2880
    sliding_window: int = 128
    context_length: int = 131072
    rms_eps: float = 1e-5
    rope_base: float = 150000.0
    shards: int = 3

    def __post_init__(self) -> None:
        if self.layers < 1 or self.skew < 0 or not 1 <= self.shards <= 99:
            raise FormatError("need layers >= 1, skew >= 0 and 1 <= shards <= 99")
        if not 0 < self.n_expert_used <= self.n_expert or self.n_head % self.n_head_kv:
            raise FormatError("need 0 < experts used <= experts and heads divisible by kv heads")
        for width in (self.hidden, self.n_head * self.head_dim, self.expert_ff):
            if width % 32:
                raise FormatError(f"row length {width} is not a multiple of 32, which MXFP4 and Q8_0 blocks need")


@dataclass(frozen=True)
class OssTensor:
    name: str
    ne: tuple[int, ...]     # ggml order: ne[0] is the row length
    qtype: Q
    std: float = 0.0        # random payload std; 0: zeros (biases, sinks) or ones (norms)
    fill: float = 0.0

    @property
    def rows(self) -> int:
        return math.prod(self.ne[1:])

    @property
    def nbytes(self) -> int:
        block, size = gguf.GGML_QUANT_SIZES[self.qtype]
        return self.rows * self.ne[0] // block * size


def plan(s: OssSpec) -> list[OssTensor]:
    """Every tensor in file order: embeddings, each layer, then the head."""
    qd, kvd, down = s.n_head * s.head_dim, s.n_head_kv * s.head_dim, PROJ_STD / math.sqrt(2 * s.layers)
    out = [OssTensor("token_embd.weight", (s.hidden, s.vocab), Q.Q8_0, 1.0)]
    for i in range(s.layers):
        p = f"blk.{i}."
        out += [OssTensor(p + "attn_norm.weight", (s.hidden,), Q.F32, fill=1.0),
                OssTensor(p + "attn_q.weight", (s.hidden, qd), Q.Q8_0, PROJ_STD),
                OssTensor(p + "attn_q.bias", (qd,), Q.F32),
                OssTensor(p + "attn_k.weight", (s.hidden, kvd), Q.Q8_0, PROJ_STD),
                OssTensor(p + "attn_k.bias", (kvd,), Q.F32),
                OssTensor(p + "attn_v.weight", (s.hidden, kvd), Q.Q8_0, PROJ_STD),
                OssTensor(p + "attn_v.bias", (kvd,), Q.F32),
                OssTensor(p + "attn_output.weight", (qd, s.hidden), Q.Q8_0, down),
                OssTensor(p + "attn_output.bias", (s.hidden,), Q.F32),
                OssTensor(p + "attn_sinks.weight", (s.n_head,), Q.F32),
                OssTensor(p + "post_attention_norm.weight", (s.hidden,), Q.F32, fill=1.0),
                OssTensor(p + "ffn_gate_inp.weight", (s.hidden, s.n_expert), Q.F32, 1 / math.sqrt(s.hidden)),
                OssTensor(p + "ffn_gate_inp.bias", (s.n_expert,), Q.F32),
                OssTensor(p + "ffn_gate_exps.weight", (s.hidden, s.expert_ff, s.n_expert), Q.MXFP4, PROJ_STD),
                OssTensor(p + "ffn_gate_exps.bias", (s.expert_ff, s.n_expert), Q.F32),
                OssTensor(p + "ffn_up_exps.weight", (s.hidden, s.expert_ff, s.n_expert), Q.MXFP4, PROJ_STD),
                OssTensor(p + "ffn_up_exps.bias", (s.expert_ff, s.n_expert), Q.F32),
                OssTensor(p + "ffn_down_exps.weight", (s.expert_ff, s.hidden, s.n_expert), Q.MXFP4, down),
                OssTensor(p + "ffn_down_exps.bias", (s.hidden, s.n_expert), Q.F32)]
    return out + [OssTensor("output_norm.weight", (s.hidden,), Q.F32, fill=1.0),
                  OssTensor("output.weight", (s.hidden, s.vocab), Q.Q8_0, PROJ_STD)]


def _rng(s: OssSpec, name: str) -> np.random.Generator:
    return np.random.default_rng([s.seed, zlib.crc32(name.encode())])


def _payload(s: OssSpec, t: OssTensor):
    """(chunk bytes) of tensor t, CHUNK_BYTES of rows at a time."""
    rng = _rng(s, t.name)
    if t.name.endswith("ffn_gate_inp.bias"):          # the router's popularity: Zipf over a permutation
        target = zipf_inclusion(s.n_expert, s.n_expert_used, s.skew)[rng.permutation(s.n_expert)]
        b = fit_biases(target, s.n_expert_used, rng) if s.skew > 0 else np.zeros(s.n_expert)
        yield b.astype(np.float32).view(np.uint8)
        return
    if t.std == 0:
        yield np.full(t.rows * t.ne[0], t.fill, np.float32).view(np.uint8)
        return
    row_bytes = t.nbytes // t.rows
    step = max(1, CHUNK_BYTES // row_bytes)
    for lo in range(0, t.rows, step):
        yield Blocks.formats[t.qtype].encode(rng, min(step, t.rows - lo), t.ne[0], t.std).reshape(-1)


def _metadata(w: gguf.GGUFWriter, s: OssSpec) -> None:
    from mawforge.synth import add_tokenizer
    w.add_name(f"mawforge-synth-gpt-oss-{s.layers}L-MXFP4")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_MXFP4_MOE)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_context_length(s.context_length)
    w.add_embedding_length(s.hidden)
    w.add_block_count(s.layers)
    w.add_feed_forward_length(s.expert_ff)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_head_kv)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_freq_base(s.rope_base)
    w.add_layer_norm_rms_eps(s.rms_eps)
    w.add_expert_count(s.n_expert)
    w.add_expert_used_count(s.n_expert_used)
    w.add_expert_feed_forward_length(s.expert_ff)
    w.add_sliding_window(s.sliding_window)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(32.0)
    w.add_rope_scaling_orig_ctx_len(4096)
    add_tokenizer(w, s.vocab)
    for key in ("seed", "skew"):
        w.add_string(f"mawforge.synth.{key}", str(getattr(s, key)))


def synth_gptoss(out: Path, spec: OssSpec, *, progress: bool = True, force: bool = False) -> list[Path]:
    """Write the shard set `out` names (`out` = DIR/NAME.gguf gives DIR/NAME-0000i-of-0000N.gguf,
    or NAME.gguf itself for one shard), atomically: the shards are written in a hidden directory
    beside them and moved into place once all are complete. Returns the shard paths in order."""
    out = Path(out)
    tensors = plan(spec)
    total = sum(t.nbytes for t in tensors)
    per_shard = -(-total // spec.shards)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    w = gguf.GGUFWriter(tmp / out.name, ARCH)
    try:
        _metadata(w, spec)
        for t in tensors:
            w.add_tensor_info(t.name, t.ne[::-1], np.dtype(np.float32), t.nbytes, raw_dtype=t.qtype)
        if spec.shards > 1:       # cut the tensor list into `shards` runs of about equal bytes
            infos, w.tensors, acc = w.tensors[0], [{} for _ in range(spec.shards)], 0
            for name, ti in infos.items():
                w.tensors[min(spec.shards - 1, acc * spec.shards // total)][name] = ti
                acc += ti.nbytes
            if any(not d for d in w.tensors):
                raise FormatError(f"{len(tensors)} tensors cannot fill {spec.shards} shards")
            w.split_max_size = per_shard
        w.write_header_to_file(tmp / out.name)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        names = w.format_shard_names(out)
        targets = [out.parent / n.name for n in names]
        for t_ in targets:
            if t_.exists() and not force:
                raise PackExists(f"{t_} exists; pass --force to overwrite")
        by_name = {t.name: t for t in tensors}
        done, t0 = 0, time.monotonic()
        for f, shard in zip(w.fout, w.tensors):
            w.write_padding(f, f.tell())
            for name in shard:
                t = by_name[name]
                wrote = 0
                for chunk in _payload(spec, t):
                    f.write(memoryview(np.ascontiguousarray(chunk)).cast("B"))
                    wrote += chunk.nbytes
                if wrote != t.nbytes:
                    raise AssertionError(f"{name}: wrote {wrote} bytes, planned {t.nbytes}")
                w.write_padding(f, t.nbytes)
                done += t.nbytes
                if progress:
                    gb = done / 1e9
                    rate = gb / max(time.monotonic() - t0, 1e-9)
                    print(f"\rsynth: {name:<28} {gb:6.1f}/{total / 1e9:.1f} GB {rate:5.2f} GB/s",
                          end="", file=sys.stderr, flush=True)
        if progress:
            print(file=sys.stderr)
        for f in w.fout:
            f.flush()
            os.fsync(f.fileno())
        w.close()
        srcs = [tmp / n.name for n in names]
        for a, b in zip(srcs, targets):
            os.replace(a, b)
        return targets
    finally:
        w.close()
        shutil.rmtree(tmp, ignore_errors=True)
