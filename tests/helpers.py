"""Shared helpers for tests: packing fixtures once per session and reading blocks back."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from gguf import quants as gq

from mawforge.codecs import quants
from mawforge.formats.source import Source
from mawforge.pack.manifest import EXPERTS, ExpertIndex

# Host capabilities some tests need. Each carries its reason, so a host without it reports a
# skip that says why instead of a failure (and nothing is skipped where the capability exists).
C_COMPILER = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
CPU_FLAGS = set(next((l for l in open("/proc/cpuinfo") if l.startswith("flags")), "").split()) \
    if os.path.exists("/proc/cpuinfo") else set()
needs_cc = pytest.mark.skipif(C_COMPILER is None, reason="needs a C compiler (native kernels compile at first use)")
needs_avx2 = pytest.mark.skipif("avx2" not in CPU_FLAGS,
                                reason="needs an AVX2 CPU (compares the AVX2 build with the scalar build)")
needs_proc_rss = pytest.mark.skipif(not os.path.exists("/proc/self/status"),
                                    reason="peak RSS is read from /proc/self/status (Linux)")

ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")
GGUF_FTYPES = ("F32", "F16", "Q8_0", "Q4_K_M")


def source_expert_f32(src: Source, layer: int, kind: str, expert: int) -> np.ndarray:
    """Reference float32 [N, K] of one expert's tensor, dequantized by the gguf library."""
    et = src.experts[(layer, kind)]
    path, off, n = et.pieces[expert]
    with open(path, "rb") as f:
        f.seek(off)
        raw = np.frombuffer(f.read(n), dtype=np.uint8)
    if et.qtype == QT.BF16:
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(et.shape)
    return gq.dequantize(raw.reshape(et.shape[0], -1), et.qtype).reshape(et.shape).astype(np.float32)


def pack_expert(pack: Path, index: ExpertIndex, layer: int, expert: int) -> dict[str, quants.PackedWeight]:
    off, n, _ = index.block(layer, expert)
    with open(pack / EXPERTS, "rb") as f:
        f.seek(off)
        buf = torch.frombuffer(bytearray(f.read(n)), dtype=torch.uint8)
    out = {}
    for t in index.layers[layer].tensors:
        specs = [quants.PartSpec(p.name, p.dtype, p.shape) for p in t.parts]
        out[t.name] = quants.get_codec(t.codec).view(buf, [p.offset for p in t.parts], specs,
                                                     QT[t.qtype], tuple(t.shape))
    return out


def run_cli(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mawforge.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def sample_outputs(rt, prompt, params: dict, speculative, n: int) -> tuple[dict, int, int]:
    """n sampled generations with seeds 0..n-1 through a speculator: (counts of each emitted
    token sequence, drafted tokens, accepted tokens) summed over the runs."""
    from mawforge.engine.generate import generate
    from mawforge.engine.sampling import SamplingParams
    counts, drafted, accepted = {}, 0, 0
    for seed in range(n):
        ev = list(generate(rt, prompt, SamplingParams(**params, seed=seed), speculative=speculative))
        key = tuple(e.token for e in ev)
        counts[key] = counts.get(key, 0) + 1
        drafted += ev[-1].telemetry.speculative["drafted"]
        accepted += ev[-1].telemetry.speculative["accepted"]
    return counts, drafted, accepted


def dashboard_pack(root: Path) -> Path:
    """A tiny synthetic Qwen3-MoE pack with enough experts for the dashboard's heatmap to show
    something (8 layers x 32 experts, top-4, skewed routing); no transformers needed."""
    from mawforge.synth import synth
    from mawforge.pack.packer import pack
    out = root / "dash.pack"
    g = synth(root / "dash.gguf", 8, quant="Q8_0", vocab=2000, skew=1.0, stickiness=0.3, report=False,
              progress=False, hidden=256, n_head=4, n_head_kv=2, head_dim=64, n_expert=32, n_expert_used=4,
              expert_ff=256)
    pack(g, out, layout="exact", progress=False)
    return out


BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def bench_module(name: str):
    """benchmarks/<name>.py imported as a module (its folder on sys.path for its own imports)."""
    import importlib.util
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def scalar_build_gemms(tmp_path: Path, raw: dict, x: torch.Tensor, n: int, k: int) -> dict:
    """native.gemm(x, raw[qt], qt, n, k) for every type of raw, computed by the portable C build
    (MAWFORGE_NATIVE_MARCH=x86-64, no AVX2) in a child process with its own kernel cache."""
    for qt, r in raw.items():
        torch.save({"raw": r, "x": x}, tmp_path / f"{qt.name}.pt")
    code = ("import sys, torch; from gguf import GGMLQuantizationType as T; from mawforge.kernels import native;"
            "assert not native.simd();"
            f"[torch.save(native.gemm(d['x'], d['raw'], T[n], {n}, {k}), sys.argv[1] + '/' + n + '.out')"
            " for n in sys.argv[2:] for d in [torch.load(sys.argv[1] + '/' + n + '.pt')]]")
    env = dict(os.environ, MAWFORGE_NATIVE_MARCH="x86-64", MAWFORGE_CACHE=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path), *[t.name for t in raw]],
                       env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return {qt: torch.load(tmp_path / f"{qt.name}.out") for qt in raw}
