"""Causal attention over a float16 KV cache: MawForge's native kernels against ggml's CPU graph for
the same attention (the one llama.cpp builds without flash attention, llama-cpp-python's default:
mul_mat K.Q, soft_max_ext, mul_mat V^T.P over its own cache layout; libggml from llama-cpp-python,
timed in a child process with the same thread count), same data, same run.

Qwen3-30B-A3B's attention (32 query heads, 4 kv heads of 128) by default; each row is a chunk of
T queries at the end of S cached positions: a prompt's 512-token batch (llama.cpp's n_batch), an
agent turn's new tokens after a long history, one decode token at 4K and 32K. MawForge runs
`attend_rows` (a prompt chunk) or `attend_one` (T = 1, the decode step). Both results are checked
against each other (float16 probabilities: within 1e-4 + a float16 ulp) before timing. Fastest of
repeats, ms; GMAC/s counts q.k and p.v over the positions each query sees. One layer's cache is
timed again and again, so at 4K it stays in L3; a decode step meets --decode-layers caches in
turn, each from memory: for T = 1 the last columns time attend_one over that many distinct caches
(MawForge only: ms a token, and GB/s of cache read), float16 and then q8_0 (`--kv-dtype q8_0`).
Run on purpose, on a quiet machine, never from the tests:

    .venv/bin/python benchmarks/attention.py [--threads 2] [--rows 512x512,2048x512,3250x250,8192x256,4096x1,32768x1]
                                             [--decode-layers 48]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import machine, save  # noqa: E402

from mawforge.fixtures.ggml_ref import ggml_attention  # noqa: E402
from mawforge.kernels import native, q8_0  # noqa: E402


def fastest_ms(fn, min_s: float = 0.5) -> float:
    fn()
    t0 = time.perf_counter()
    fn()
    once = max(time.perf_counter() - t0, 1e-6)
    best = once
    for _ in range(max(3, min(100, int(min_s / once)))):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def layers_ms(q, keys, vals, scale: float, layers: int, g: torch.Generator, q8: bool = False) -> float:
    """attend_one over `layers` distinct caches shaped as keys/vals (float16, or with q8 ggml's q8_0 rows
    of rotated keys and values: --kv-dtype q8_0), one after another as a decode step's layers run:
    fastest of repeats, ms"""
    def cache(rot):
        x = torch.randn(keys.shape, generator=g)
        return q8_0.quantize(rot(x)) if q8 else x.half()
    caches = [(cache(q8_0.rot_k), cache(q8_0.rot_v)) for _ in range(layers)]

    def step():
        for k, v in caches:
            native.attend_one(q, k, v, scale)
    return fastest_ms(step)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--heads", default="32,4,128", help="query heads, kv heads, head dim")
    ap.add_argument("--rows", default="512x512,2048x512,3250x250,8192x256,4096x1,32768x1",
                    help="S x T: T queries at the end of S cached positions")
    ap.add_argument("--decode-layers", type=int, default=48,
                    help="distinct caches a decode row (T = 1) is also timed over, as one token's layers (0: not)")
    args = ap.parse_args()
    H, G, D = (int(v) for v in args.heads.split(","))
    native.set_thread_limit(args.threads)
    print(f"# attention, {machine()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
          f"{args.threads} threads, H {H} G {G} D {D}, float16 cache")
    L = args.decode_layers
    print(f"{'S':>6} {'T':>5} {'MawForge ms':>12} {'GMAC/s':>7} {'ggml ms':>9} {'GMAC/s':>7} {'ggml / MawForge':>16}"
          + (f" {f'MawForge {L} layers ms':>22} {'GB/s':>6} {'q8_0 ms':>8} {'GB/s':>6}" if L else ""))
    rows = []
    for spec in args.rows.split(","):
        S, T = (int(v) for v in spec.split("x"))
        g = torch.Generator().manual_seed(S + T)
        q = torch.randn(T, H, D, generator=g)
        keys, vals = torch.randn(G, S, D, generator=g).half(), torch.randn(G, S, D, generator=g).half()
        scale = D ** -0.5
        fn = (lambda: native.attend_one(q, keys, vals, scale)) if T == 1 else \
            (lambda: native.attend_rows(q, keys, vals, scale))
        ours = fn()
        ref, ggml_ms = ggml_attention(q.numpy(), keys.numpy(), vals.numpy(), scale, threads=args.threads,
                                      repeat=max(3, min(50, 2_000_000_000 // (S * T * H * D * 2))))
        torch.testing.assert_close(ours, torch.from_numpy(ref), rtol=1e-4, atol=1e-5 + 4 * 2.0 ** -11)
        ms = fastest_ms(fn)
        macs = 2.0 * H * D * sum(S - T + t + 1 for t in range(T))
        row = dict(S=S, T=T, mawforge_ms=ms, ggml_ms=ggml_ms, mawforge_gmac_s=macs / ms * 1e-6,
                   ggml_gmac_s=macs / ggml_ms * 1e-6, ggml_over_mawforge=ggml_ms / ms)
        tail = ""
        if T == 1 and L:
            row.update(layers_ms=layers_ms(q, keys, vals, scale, L, g))
            row.update(layers_cache_gb_s=L * 2 * keys.numel() * keys.element_size() / row["layers_ms"] * 1e-6)
            row.update(q8_layers_ms=layers_ms(q, keys, vals, scale, L, g, q8=True))
            row.update(q8_layers_cache_gb_s=L * 2 * keys.numel() * 34 / 32 / row["q8_layers_ms"] * 1e-6)
            tail = (f" {row['layers_ms']:>22.2f} {row['layers_cache_gb_s']:>6.1f} {row['q8_layers_ms']:>8.2f}"
                    f" {row['q8_layers_cache_gb_s']:>6.1f}")
        rows.append(row)
        print(f"{S:>6} {T:>5} {ms:>12.3f} {row['mawforge_gmac_s']:>7.1f} {ggml_ms:>9.3f} {row['ggml_gmac_s']:>7.1f} "
              f"{row['ggml_over_mawforge']:>15.2f}x" + tail, flush=True)
    native.set_thread_limit(None)
    print(f"saved {save('attention', dict(machine=machine(), args=vars(args), rows=rows))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
