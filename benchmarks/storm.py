#!/usr/bin/env python3
"""Server storm: starts `mawforge serve` on 127.0.0.1, runs mawforge.fuzz.storm against it
(concurrent good requests, malformed requests, disconnects, large bad bodies while /health is
polled, an overload burst), then SIGTERMs it with streams in flight, and prints the figures:
statuses per phase, /health latency (p50/p99/max) while the large bodies arrive, the drain
outcome and the server's exit code. A benchmark, not a test: latencies depend on the machine.

    python benchmarks/storm.py --pack PACK [--clients 16 --requests 12 --big-bodies 8 --big-mb 5]
    python benchmarks/storm.py --synth      # builds a tiny synthetic pack under work/storm first
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mawforge.fuzz.storm import Storm, storm  # noqa: E402


def start_server(pack: Path, context: int, queue: int, log: Path,
                 root: Path | None = None) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": str(root)} if root else None     # --server-root: serve another checkout
    p = subprocess.Popen([sys.executable, "-m", "mawforge.cli", "serve", "--pack", str(pack.resolve()),
                          "--model-id", "storm", "--port", "0", "--context", str(context), "--threads", "1",
                          "--queue-size", str(queue),
                          "--memory-budget-gib", "4", "--expert-cache-percent", "100", "--no-speculative",
                          "--telemetry-log", str(log.resolve()), "--shutdown-grace-s", "5"],
                         stderr=subprocess.PIPE, text=True, env=env, cwd=root)
    for line in p.stderr:
        m = re.search(r"listening on (http://\S+)", line)
        if m:
            return p, m.group(1)
    raise SystemExit(f"the server did not start (exit {p.wait()})")


def synth_pack(root: Path) -> Path:
    from mawforge.synth import synth
    from mawforge.pack.packer import pack
    root.mkdir(parents=True, exist_ok=True)
    g, out = root / "tiny.gguf", root / "tiny.pack"
    if not g.exists():
        synth(g, 2, vocab=1024, hidden=256, n_head=4, n_head_kv=2, head_dim=64, n_expert=8, n_expert_used=2,
              expert_ff=256, dense_ff=512, report=False, progress=False)
    if not (out / "manifest.json").exists():
        pack(g, out, progress=False, force=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pack", type=Path)
    ap.add_argument("--synth", action="store_true")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--queue-size", type=int, default=2)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=12, help="good requests per client")
    ap.add_argument("--disconnects", type=int, default=20)
    ap.add_argument("--big-bodies", type=int, default=8)
    ap.add_argument("--big-mb", type=float, default=5.0)
    ap.add_argument("--overload", type=int, default=24)
    ap.add_argument("--out", type=Path, default=Path("bench-runs/storm"))
    ap.add_argument("--server-root", type=Path, default=None,
                    help="run the server from another checkout (e.g. main, for a before/after figure)")
    a = ap.parse_args()
    pack = a.pack or synth_pack(Path("work/storm"))
    a.out.mkdir(parents=True, exist_ok=True)
    log = a.out / "telemetry.jsonl"
    log.unlink(missing_ok=True)
    proc, url = start_server(pack, a.context, a.queue_size, log, a.server_root)
    cfg = Storm(clients=a.clients, requests=a.requests, disconnects=a.disconnects, big_bodies=a.big_bodies,
                big_mb=a.big_mb, overload=a.overload)
    t0 = time.perf_counter()
    try:
        res = storm(url, "storm", cfg, a.context, terminate=proc.terminate)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    fig = res.figures()
    texts: dict = {}
    for key, status, text in res.good:
        texts.setdefault(key, set()).add(text)
    lines = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    fig.update(wall_s=round(time.perf_counter() - t0, 1), exit_code=code, sent=dict(res.sent),
               sent_total=sum(res.sent.values()), telemetry_lines=len(lines),
               statuses_5xx=sum(1 for x in lines if x["status"] >= 500),
               deterministic=all(len(v) == 1 for v in texts.values()),
               malformed_not_4xx=[n for n, s, e in res.malformed if not 400 <= s < 500 or e is None])
    (a.out / "storm.json").write_text(json.dumps(fig, indent=1))
    print(json.dumps(fig, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
