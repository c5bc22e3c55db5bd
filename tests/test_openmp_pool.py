"""engine/threads.py release_openmp_pool: the thread that loaded a model hands the compute to
another thread (`serve`'s engine thread) and its idle OpenMP workers exit, so libgomp does not
count two pools against the CPUs (which makes every barrier sleep in the kernel: decode at half
speed on the engine thread, benchmarks/RESULTS.md). The probe runs in a fresh interpreter, since
the pools are per process."""
from __future__ import annotations

import subprocess
import sys

PROBE = r"""
import os, threading, time, torch
from mawforge.engine.threads import release_openmp_pool
torch.set_num_threads(2)

def tasks():
    return len(os.listdir("/proc/self/task"))

def parallel():                    # above at::parallel_for's grain: a parallel region, a pool
    x = torch.ones(1 << 22)
    x.mul_(1.5).add_(x)
    return float(x[0])

def settle(want):
    for _ in range(200):           # an exiting worker leaves /proc a moment after the barrier
        if tasks() == want:
            break
        time.sleep(0.01)
    return tasks()

base = tasks()
parallel()
pooled = tasks()
out = {"worker_made": pooled > base}
out["released"] = release_openmp_pool()
out["workers_gone"] = settle(base) == base
parallel()
out["pool_back"] = settle(pooled) == pooled
# the server's case: the loading thread releases, then an engine thread computes: only its pool is left
release_openmp_pool()
settle(base)
seen = []
def engine():
    parallel()
    seen.append(tasks())
t = threading.Thread(target=engine)
t.start(); t.join()
out["engine_only"] = seen[0] == pooled + 1     # the main thread, the engine thread, its one worker
print(out)
"""


def _probe() -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return eval(out.stdout.strip().splitlines()[-1])


def test_release_lets_the_calling_threads_openmp_workers_exit_and_the_pool_comes_back_on_use():
    r = _probe()
    assert r["worker_made"], r                  # torch's libgomp made a worker for the main thread
    assert r["released"], r
    assert r["workers_gone"], r
    assert r["pool_back"], r
    assert r["engine_only"], r


def test_serve_releases_the_loading_threads_pool_once_the_app_is_built(monkeypatch, fixtures_root, tmp_path):
    """`serve` (and each Ray replica: both build through app_for) releases the loading thread's
    pool after the model and the app are built, before the engine thread runs anything."""
    import argparse

    from mawforge.commands import serve
    from mawforge.pack.packer import pack
    from mawforge.serve.servecli import chat_settings

    out = tmp_path / "p.pack"
    pack(fixtures_root["qwen3_moe"]["gguf"]["Q8_0"], out, progress=False)
    calls = []
    monkeypatch.setattr(serve, "release_openmp_pool", lambda: calls.append("released") or True)
    real_build = serve.build_app
    monkeypatch.setattr(serve, "build_app", lambda *a, **k: calls.append("built") or real_build(*a, **k))
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    a = p.parse_args(["--pack", str(out), "--context", "256", "--threads", "1", "--no-dashboard", "--preload",
                      "--expert-cache-percent", "100"])
    opts, _, run_plan = serve.plan_served(a)
    app, model = serve.app_for(a, opts, run_plan, chat_settings(a))
    try:
        assert calls == ["built", "released"]
        assert model.runtime.cache.held > 0          # the model loaded (and preloaded) first
    finally:
        model.close()
