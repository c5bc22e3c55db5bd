"""linear() per source type against a dense bf16 matmul of the same shape, same run, and for
GGUF quant types against ggml's own CPU mul_mat on the same bytes (libggml from
llama-cpp-python, timed in a child process with the same thread count: the peer).

Qwen3-30B-A3B expert matrices (gate/up 768x2048, down 2048x768; --shapes for others), decode
(M=1) and prefill (M=64); the weights stay in L2/L3 across repeats (benchmarks/moe_ffn.py reads
them from DRAM). Prints a table of ms, ratio to dense bf16, ggml ms and our/ggml ratio, and effective
GB/s of packed bytes, and writes JSON lines with --out. Run on purpose, never from the tests:

    .venv/bin/python benchmarks/kernels.py --threads 2 [--types Q4_K,Q8_0] [--out r.jsonl]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from gguf import GGMLQuantizationType as T

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import numpy as np  # noqa: E402

from mawforge.fixtures.ggml_ref import ggml_matmul  # noqa: E402
from mawforge.codecs import quants  # noqa: E402
from mawforge.kernels import cpu  # noqa: E402
from test_native_types import random_rows  # noqa: E402
from test_quants import QUANTIZABLE, RANDOM_BLOCKS, pack, source_bytes  # noqa: E402

TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "MXFP4",
         "Q2_K", "Q3_K", "IQ4_XS", "IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M"]


def weight_bytes(t: T, shape) -> np.ndarray:
    """test_quants' sources where it has them (quantized or random blocks), else test_native_types'
    random blocks with sane scales (the IQ types)"""
    if t in (T.F32, T.F16, T.BF16, *QUANTIZABLE, *RANDOM_BLOCKS):
        return source_bytes(t, shape)
    return random_rows(t, *shape, seed=0).numpy().reshape(-1)


def timed(fn, min_s: float = 0.2) -> float:
    """Fastest of repeats filling about min_s, in ms: the minimum, because the cores are
    shared and any other process inflates a median (OpenMP waits on a busy core)."""
    fn()
    t0 = time.perf_counter()
    fn()
    once = max(time.perf_counter() - t0, 1e-6)
    reps = max(3, min(200, int(min_s / once)))
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return min(samples) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--tokens", default="1,64")
    ap.add_argument("--shapes", default="768x2048,2048x768",
                    help="N x K list; the attention projections are 4096x2048,512x2048,2048x4096")
    ap.add_argument("--layout", default="exact", choices=["exact", "int4pack"])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    print(f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, threads {args.threads}")
    print(f"{'type':6} {'codec':16} {'N x K':>10} {'M':>3} {'ms':>8} {'bf16 ms':>8} {'ratio':>6} "
          f"{'ggml ms':>8} {'x ggml':>6} {'GB/s':>6}")
    for name in args.types.split(","):
        t = T[name]
        for shape in [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]:
            codec = quants.choose_codec(t, args.layout, shape)
            w = pack(codec, weight_bytes(t, shape), t, shape)
            dense = torch.randn(shape, dtype=torch.bfloat16)
            for m in (int(v) for v in args.tokens.split(",")):
                x = torch.randn(m, shape[1])
                xb = x.bfloat16()
                ms = timed(lambda: cpu.linear(x, w))
                peer = timed(lambda: torch.nn.functional.linear(xb, dense))
                gg = None
                if name != "F32":
                    raw = weight_bytes(t, shape)
                    _, gg = ggml_matmul(np.asarray(raw, np.uint8).reshape(shape[0], -1), int(t), shape[0],
                                        shape[1], x.numpy(), threads=args.threads, repeat=200)
                row = dict(type=name, codec=codec.name, n=shape[0], k=shape[1], m=m, ms=ms, bf16_ms=peer,
                           ratio=ms / peer, ggml_ms=gg, x_ggml=None if gg is None else ms / gg,
                           packed_bytes=w.nbytes, gbps=w.nbytes / ms / 1e6)
                rows.append(row)
                g = f"{gg:8.3f} {ms / gg:6.2f}" if gg is not None else f"{'':8} {'':6}"
                print(f"{name:6} {codec.name:16} {shape[0]:>4}x{shape[1]:<5} {m:>3} {ms:8.3f} {peer:8.3f} "
                      f"{row['ratio']:6.2f} {g} {row['gbps']:6.2f}")
    if args.out:
        args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
