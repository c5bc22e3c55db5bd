"""What the dashboard costs decoding: decode tok/s of the same greedy request, in rounds that
alternate three servers in one process (this VM's speed drifts within minutes, so only
ratios inside a round are compared):

  off        build_app(dashboard=False): no per-block counts, no per-request trace
  on         the dashboard on (counts and per-request trace kept), no page connected
  connected  the dashboard on and its event stream read by another process, like a browser

Each server has its own Runtime on the same pack; the order of the three rotates per round.
Prints per-round tok/s and the median of the per-round ratios connected/on (the cost of
streaming) and connected/off (the whole cost). Wall-clock tok/s on a shared 2-core VM swings
by tens of percent, so two steadier figures come beside it: the engine thread's CPU time per
decoded token (time.thread_time, which other processes do not inflate), and what building and
encoding one frame costs (the event loop holds the GIL that long every interval).

    python benchmarks/dashboard_overhead.py --rounds 7                 # 8 layers x 32 experts
    python benchmarks/dashboard_overhead.py --frame-grid 48x128        # one frame's cost, no model
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

READER = """
import sys, urllib.request
with urllib.request.urlopen(sys.argv[1] + "/dashboard/events") as r:
    for line in r:
        if line.startswith(b"event: frame"):
            print("frame", flush=True)
"""


def make_pack(root: Path, layers: int, experts: int) -> Path:
    from mawforge.synth import synth
    from mawforge.pack.packer import pack
    out = root / f"dash-L{layers}-E{experts}.pack"
    if not out.exists():
        g = synth(root / f"dash-L{layers}-E{experts}.gguf", layers, quant="Q8_0", vocab=2000, skew=1.0,
                  stickiness=0.3, report=False, progress=False, hidden=256, n_head=4, n_head_kv=2, head_dim=64,
                  n_expert=experts, n_expert_used=4, expert_ff=256)
        pack(g, out, layout="exact", progress=False)
    return out


def engine_cpu(worker, sink: list):
    """Wrap the worker's generate: CPU seconds of the engine thread per decoded token."""
    inner = worker.generate

    def generate(*args, **kw):
        t_first = None
        for ev in inner(*args, **kw):
            if t_first is None:
                t_first = time.thread_time()
            if ev.telemetry is not None and ev.telemetry.completion_tokens > 1:
                sink.append((time.thread_time() - t_first) / (ev.telemetry.completion_tokens - 1))
            yield ev
    worker.generate = generate


def frame_cost(board, n: int = 200) -> float:
    """Seconds to build and encode one frame (the cache as the last request left it)."""
    from mawforge.serve.dashboard import Sampler, _sse
    sampler = Sampler(board)
    t0 = time.perf_counter()
    for _ in range(n):
        _sse("frame", sampler.frame())
    return (time.perf_counter() - t0) / n


def per_token_cost(rt, accesses_per_token: float, n: int = 20000) -> dict:
    """The two things the dashboard adds to every decode step, timed alone (best of 15, so the
    load of other processes mostly drops out): a heat count per cache access, a routing copy per layer."""
    import timeit

    import numpy as np

    from mawforge.cache.core import CacheCore
    from mawforge.cache.policies import make_policy
    from mawforge.serve.dashboard import RequestTraces
    keys = [(i % rt.cfg.n_layers, i % rt.cfg.n_experts) for i in range(64)]
    cores = {}
    for heat in (False, True):
        core = cores[heat] = CacheCore(1 << 40, make_policy("lru"))
        if heat:
            core.track_heat(rt.cfg.n_layers, rt.cfg.n_experts)
        for k in keys:
            core.access(k, 1)
    best = {False: float("inf"), True: float("inf")}
    for _ in range(15):                                  # interleaved, so drift hits both alike
        for h in (False, True):
            best[h] = min(best[h], timeit.timeit(lambda c=cores[h]: [c.access(k, 1) for k in keys], number=n // 64))
    hit = {h: t / (n // 64 * len(keys)) for h, t in best.items()}
    traces = RequestTraces(rt)
    traces.start()
    idx = np.arange(rt.cfg.top_k, dtype=np.int64)[None, :]
    w = np.full((1, rt.cfg.top_k), 1.0 / rt.cfg.top_k, dtype=np.float32)

    def step():
        traces.begin_step("decode", 1)
        for layer in range(rt.cfg.n_layers):
            traces.record(layer, idx, w)
        traces.rows = 0                                  # stay under the row cap
    record = min(timeit.repeat(step, number=500, repeat=15)) / 500
    return {"heat_s": accesses_per_token * (hit[True] - hit[False]), "trace_s": record}


def frame_cost_at(layers: int, experts: int, top_k: int = 8, percent: float = 25, rounds: int = 30) -> float:
    """CPU seconds (median) of one frame for a cache of `layers` x `experts` blocks without a
    model: a torch-free CacheCore driven by Zipf routing, five decode steps between frames."""
    import types

    import numpy as np

    from mawforge.cache.core import CacheCore
    from mawforge.cache.driver import RouteDriver
    from mawforge.cache.policies import make_policy
    from mawforge.serve.dashboard import Board, Sampler, _sse
    core = CacheCore(int(layers * experts * 100 * percent / 100), make_policy("lru"))
    core.track_heat(layers, experts)
    driver, rng = RouteDriver(core, lambda layer, expert: 100), np.random.default_rng(0)
    p = 1.0 / np.arange(1, experts + 1)
    p /= p.sum()

    def steps(n):
        for _ in range(n):
            driver.begin_step("decode", 1)
            for layer in range(layers):
                for _ in driver.layer(layer, rng.choice(experts, size=(1, top_k), replace=False, p=p)):
                    pass
    steps(200)
    cache = types.SimpleNamespace(core=core, driver=driver, load_seconds=0.0, prefetch_stall_seconds=0.0)
    board = types.SimpleNamespace(core=core, n_experts=experts, seq=0, tokens=0,
                                  rt=types.SimpleNamespace(cache=cache, kv=types.SimpleNamespace(pos=0)),
                                  worker=types.SimpleNamespace(current=None, queue_depth=0))
    board.totals = lambda snap=None: Board.totals(board, snap)
    sampler, cpu = Sampler(board), []
    for _ in range(rounds):
        steps(5)
        t = time.thread_time()
        _sse("frame", sampler.frame())
        cpu.append(time.thread_time() - t)
    return statistics.median(cpu)


def decode_tok_s(url: str, tokens: int) -> float:
    body = json.dumps({"model": "bench", "prompt": "The expert cache reads", "max_tokens": tokens,
                       "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        tel = json.loads(r.read())["telemetry"]
    assert tel["completion_tokens"] == tokens, tel
    return tel["decode_tok_s"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", type=Path, default=Path("bench-runs/dashboard"))
    ap.add_argument("--pack", type=Path, default=None,
                    help="an existing pack (e.g. a shape-true one) instead of the tiny synthetic pack")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--cache-percent", type=float, default=30)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--frame-grid", default=None, metavar="LxE",
                    help="only time one frame for a LxE cache without a model (e.g. 48x128)")
    a = ap.parse_args()
    if a.frame_grid:
        layers, experts = (int(x) for x in a.frame_grid.lower().split("x"))
        cpu = frame_cost_at(layers, experts)
        print(f"{layers} layers x {experts} experts, top-8, 25% cache, Zipf routing: one frame {1e6 * cpu:.0f} us "
              f"of CPU (median of 30), every 200 ms: {100 * cpu / 0.2:.2f}% of one core's time")
        return 0
    from mawforge.engine.runtime import Runtime, RuntimeOptions
    from mawforge.serve.app import ServerThread, build_app
    a.root.mkdir(parents=True, exist_ok=True)
    pack = a.pack or make_pack(a.root, a.layers, a.experts)
    opts = RuntimeOptions(context=a.tokens + 64, expert_cache_percent=a.cache_percent, threads=a.threads)
    rts = {name: Runtime(pack, opts) for name in ("off", "on")}
    apps = {"off": build_app(rts["off"], "bench", dashboard=False), "on": build_app(rts["on"], "bench")}
    cpu = {"off": [], "on": [], "connected": []}
    servers = {name: ServerThread(app).start() for name, app in apps.items()}
    rows = []
    try:
        for name in ("off", "on"):
            decode_tok_s(servers[name].url, 16)        # warm both
        for name in ("off", "on"):
            engine_cpu(apps[name].state.worker, cpu[name])
        for rnd in range(a.rounds):
            row = {}
            for name in ("off", "on", "connected")[rnd % 3:] + ("off", "on", "connected")[:rnd % 3]:
                if name != "connected":
                    row[name] = decode_tok_s(servers[name].url, a.tokens)
                    continue
                reader = subprocess.Popen([sys.executable, "-c", READER, servers["on"].url], stdout=subprocess.PIPE,
                                          text=True)
                reader.stdout.readline()                # the stream is flowing
                row["connected"] = decode_tok_s(servers["on"].url, a.tokens)
                cpu["connected"].append(cpu["on"].pop())
                reader.terminate()
                row["frames"] = 1 + sum(1 for _ in reader.stdout)
                reader.wait()
            rows.append(row)
            print(f"round {rnd}: off {row['off']:.1f}  on {row['on']:.1f}  connected {row['connected']:.1f} tok/s"
                  f"  ({row['frames']} frames read)", flush=True)
            time.sleep(0.2)
        per_frame = frame_cost(apps["on"].state.board)
        last = apps["on"].state.board.requests[-1]
        cost = per_token_cost(rts["on"], (last["hits"] + last["misses"]) / last["completion_tokens"])
    finally:
        for s in servers.values():
            s.stop()
        for rt in rts.values():
            rt.close()
    med = lambda k1, k2: statistics.median(r[k1] / r[k2] for r in rows)
    print(f"{a.layers} layers x {a.experts} experts, cache {a.cache_percent}%, {a.tokens} tokens, {a.rounds} rounds")
    print(f"median connected/on  {med('connected', 'on'):.4f}   (streaming the dashboard)")
    print(f"median on/off        {med('on', 'off'):.4f}   (counts and per-request trace)")
    print(f"median connected/off {med('connected', 'off'):.4f}   (everything)")
    ms = {k: 1000 * statistics.median(v) for k, v in cpu.items()}
    print(f"engine-thread CPU per decoded token, median: off {ms['off']:.3f} ms, on {ms['on']:.3f} ms, "
          f"connected {ms['connected']:.3f} ms (connected/off {ms['connected'] / ms['off']:.4f})")
    added = cost["heat_s"] + cost["trace_s"]
    print(f"added per decoded token, timed alone: heat counts {1e6 * cost['heat_s']:.1f} us + route trace "
          f"{1e6 * cost['trace_s']:.1f} us = {1e6 * added:.1f} us, {100 * added / (ms['off'] / 1000):.2f}% of the "
          f"engine's {ms['off']:.3f} ms")
    interval = apps["on"].state.board.interval_s
    print(f"one frame: {1e6 * per_frame:.0f} us to build and encode, every {interval * 1000:.0f} ms: "
          f"{100 * per_frame / interval:.3f}% of one core's time")
    return 0


if __name__ == "__main__":
    sys.exit(main())
