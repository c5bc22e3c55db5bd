"""native.moe_ffn shaped as one Qwen3-30B-A3B decode layer (8 routed experts of gate/up
768x2048 Q4_K and down 2048x768 Q6_K or Q4_K), with the expert blocks spread over a pool of
more than 100 MB and each call taking the next 8 experts of the pool, so the bytes come from
DRAM as in a real decode and not from L2/L3. Against ggml's own mul_mat_id graph (gate, up,
silu * up, down) on the same bytes, the same pool rotation and the same thread count, timed in a
child process (libggml from llama-cpp-python: the peer).

Prints ms (median of calls), GB/s of expert bytes read, ggml's ms and our/ggml ratio:

    .venv/bin/python benchmarks/moe_ffn.py --threads 2 [--pool 40] [--calls 200]

Cases: M=1 (one token, 8 pairs); M=4 shared (4 tokens on the same 8 experts: the four-row
kernels); M=4 spread (4 tokens on 32 different experts, one pair each).
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

C, F = 2048, 768
BLOCK = {12: (144, 256), 14: (210, 256)}          # GGUF type id -> (bytes, values) a block
CASES = (("M=1", 1, 8), ("M=4 shared", 4, 8), ("M=4 spread", 4, 32))   # name, tokens, experts a call


def random_blocks(rng, t: int, e: int, n: int, k: int) -> np.ndarray:
    """[e, n, row bytes] of type t: random bits with small finite float16 scales (speed only)."""
    nbytes, qk = BLOCK[t]
    w = rng.integers(0, 256, (e, n, k // qk, nbytes), dtype=np.uint8)
    f16 = lambda: rng.uniform(-0.01, 0.01, (e, n, k // qk)).astype(np.float16).view(np.uint8).reshape(e, n, k // qk, 2)
    for off in ((0, 2) if t == 12 else (208,)):
        w[..., off:off + 2] = f16()
    return w.reshape(e, n, -1)


def routes(case: tuple, pool: int, call: int) -> tuple[np.ndarray, np.ndarray]:
    """ids [M, 8] (expert of each token's slot) and weights [M, 8] for call number `call`."""
    _, m, ne = case
    base = (call * ne) % pool
    experts = (base + np.arange(ne)) % pool
    ids = np.resize(experts, (m, 8)) if ne == 8 else experts.reshape(m, 8)
    return ids.astype(np.int32), np.full((m, 8), 0.125, np.float32)


def ours(w: dict, types, case, pool: int, calls: int, threads: int) -> list[float]:
    import torch
    from mawforge.kernels import native
    torch.set_num_threads(threads)
    _, m, _ = case
    x = torch.randn(m, C)
    out = torch.zeros(m, C)
    times = []
    for i in range(calls):
        ids, wt = routes(case, pool, i)
        used = sorted(set(ids.reshape(-1).tolist()))
        wts = np.zeros((len(used), m), np.float32)
        for t in range(m):
            for s in range(8):
                wts[used.index(ids[t, s]), t] = wt[t, s]
        batch = native.ExpertBatch(types, F, C)
        for e in used:
            batch.add(w["gate"][e].ctypes.data, w["up"][e].ctypes.data, w["down"][e].ctypes.data)
        pairs = native.pairs_from_weights(wts)
        t0 = time.perf_counter()
        native.moe_ffn(x, batch, wts, out, pairs)
        times.append(time.perf_counter() - t0)
    return times


def ggml_child(src: str, out: str) -> int:
    """Runs in a child: ggml's mul_mat_id graph over the pool, timed per call."""
    from mawforge.fixtures.ggml_ref import _Params, ggml_lib_dir
    d = np.load(src)
    tg, td, m, ne, pool, calls, threads = (int(v) for v in d["meta"])
    lib = ggml_lib_dir()
    base = ctypes.CDLL(str(lib / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
    cpu = ctypes.CDLL(str(lib / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
    P, I64 = ctypes.c_void_p, ctypes.c_int64
    for f, args, res in ((base.ggml_init, [_Params], P), (base.ggml_new_tensor_3d, [P, ctypes.c_int, I64, I64, I64], P),
                         (base.ggml_new_tensor_2d, [P, ctypes.c_int, I64, I64], P),
                         (base.ggml_mul_mat_id, [P, P, P, P], P), (base.ggml_silu, [P, P], P),
                         (base.ggml_mul, [P, P, P], P),
                         (base.ggml_new_graph, [P], P), (base.ggml_build_forward_expand, [P, P], None),
                         (base.ggml_get_data, [P], P), (base.ggml_nbytes, [P], ctypes.c_size_t),
                         (base.ggml_free, [P], None),
                         (cpu.ggml_graph_compute_with_ctx, [P, P, ctypes.c_int], ctypes.c_int)):
        f.argtypes, f.restype = args, res
    cpu.ggml_cpu_init()
    total = sum(d[k].nbytes for k in ("gate", "up", "down"))
    ctx = base.ggml_init(_Params(total + (256 << 20), None, False))
    tensors = {}
    for k, t, (k0, k1) in (("gate", tg, (C, F)), ("up", tg, (C, F)), ("down", td, (F, C))):
        a = base.ggml_new_tensor_3d(ctx, t, k0, k1, pool)
        assert base.ggml_nbytes(a) == d[k].nbytes, k
        ctypes.memmove(base.ggml_get_data(a), d[k].ctypes.data, d[k].nbytes)
        tensors[k] = a
    x = base.ggml_new_tensor_3d(ctx, 0, C, 1, m)                      # F32 [C, 1, M]
    ids = base.ggml_new_tensor_2d(ctx, 26, 8, m)                      # I32 [8, M]
    xv = np.random.default_rng(1).standard_normal((m, C)).astype(np.float32)
    ctypes.memmove(base.ggml_get_data(x), xv.ctypes.data, xv.nbytes)
    g = base.ggml_mul_mat_id(ctx, tensors["gate"], x, ids)            # [F, 8, M]
    u = base.ggml_mul_mat_id(ctx, tensors["up"], x, ids)
    h = base.ggml_mul(ctx, base.ggml_silu(ctx, g), u)
    y = base.ggml_mul_mat_id(ctx, tensors["down"], h, ids)            # [C, 8, M]
    graph = base.ggml_new_graph(ctx)
    base.ggml_build_forward_expand(graph, y)
    case = ("", m, ne)
    times = []
    for i in range(calls):
        idv, _ = routes(case, pool, i)
        ctypes.memmove(base.ggml_get_data(ids), idv.ctypes.data, idv.nbytes)
        t0 = time.perf_counter()
        if cpu.ggml_graph_compute_with_ctx(ctx, graph, threads) != 0:
            raise SystemExit("ggml graph compute failed")
        times.append(time.perf_counter() - t0)
    base.ggml_free(ctx)
    np.save(out, np.array(times))
    return 0


def ggml_times(w: dict, types, case, pool: int, calls: int, threads: int) -> list[float] | None:
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "in.npz", Path(tmp) / "out.npy"
        _, m, ne = case
        np.savez(src, gate=w["gate"], up=w["up"], down=w["down"],
                 meta=np.array([types[0], types[2], m, ne, pool, calls, threads], np.int64))
        r = subprocess.run([sys.executable, __file__, "--ggml-child", str(src), str(out)],
                           capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            print(f"ggml child failed: {r.stderr[-1500:]}", file=sys.stderr)
            return None
        return list(np.load(out))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pool", type=int, default=40, help="experts in the pool (40: 106-122 MB)")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--down", default="Q6_K,Q4_K")
    ap.add_argument("--no-ggml", action="store_true")
    ap.add_argument("--ggml-child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.ggml_child:
        return ggml_child(*args.ggml_child)
    rng = np.random.default_rng(0)
    gate = random_blocks(rng, 12, args.pool, F, C)
    up = random_blocks(rng, 12, args.pool, F, C)
    print(f"{'down':5} {'case':11} {'MB/call':>7} {'ms':>7} {'GB/s':>6} {'ggml ms':>8} {'ggml GB/s':>9} {'x ggml':>6}")
    for name in args.down.split(","):
        td = {"Q6_K": 14, "Q4_K": 12}[name]
        w = {"gate": gate, "up": up, "down": random_blocks(rng, td, args.pool, C, F)}
        pool_mb = sum(a.nbytes for a in w.values()) / 1e6
        types_ids = (12, 12, td)
        from gguf import GGMLQuantizationType as T
        types = tuple(T(t) for t in types_ids)
        for case in CASES:
            per_expert = w["gate"][0].nbytes + w["up"][0].nbytes + w["down"][0].nbytes
            nbytes = case[2] * per_expert
            ms = statistics.median(ours(w, types, case, args.pool, args.calls, args.threads)[3:]) * 1e3
            gg = None if args.no_ggml else ggml_times(w, types_ids, case, args.pool, args.calls, args.threads)
            gms = statistics.median(gg[3:]) * 1e3 if gg else None
            g = f"{gms:8.3f} {nbytes / gms / 1e6:9.2f} {ms / gms:6.2f}" if gms else f"{'':8} {'':9} {'':6}"
            print(f"{name:5} {case[0]:11} {nbytes / 1e6:7.2f} {ms:7.3f} {nbytes / ms / 1e6:6.2f} {g}"
                  f"   (pool {pool_mb:.0f} MB)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
