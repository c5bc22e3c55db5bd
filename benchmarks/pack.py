"""Pack throughput against `cp` of the same file in the same run (both from a cold page cache,
both ending with their data on disk), and the packer's peak RSS.

    python benchmarks/pack.py [--layers 24] [--repeat 3]

Targets (issue 2): >= 0.7x cp throughput, peak RSS <= 1 GiB, for a shape-true GGUF >= 8 GB.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(__file__))
from common import PY, WORK, drop_caches, machine, median, run_child, run_measured, save, synth_model  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--quant", default="Q4_K_M")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--layouts", default="exact,int4pack")
    a = ap.parse_args()
    src = synth_model(a.layers, a.quant)
    size = os.path.getsize(src)
    dst = WORK / "cp-copy.gguf"
    rows = {"cp": []}
    rss = {}
    for layout in a.layouts.split(","):
        rows[layout] = []
    for _ in range(a.repeat):
        drop_caches()
        r = run_child(["sh", "-c", f"cp '{src}' '{dst}' && sync -f '{dst}'"])
        assert r["rc"] == 0, r["stderr"]
        rows["cp"].append(r["wall_s"])
        os.remove(dst)
        for layout in a.layouts.split(","):
            out = WORK / f"bench-{layout}.pack"
            drop_caches()
            r = run_measured([PY, "-m", "mawforge.cli", "pack", str(src), "-o", str(out), "--layout", layout,
                              "--force", "--quiet"])
            assert r["rc"] == 0, r["stderr"]
            rows[layout].append(r["wall_s"])
            rss[layout] = max(rss.get(layout, 0), r["peak_rss_bytes"])
            shutil.rmtree(out)
    cp = median(rows["cp"])
    print(f"# pack benchmark: {src.name}, {size / 1e9:.2f} GB, {a.repeat} cold runs each; {machine()}")
    print(f"{'what':14s} {'median s':>9s} {'GB/s':>7s} {'x cp':>6s} {'peak RSS MiB':>13s}  runs")
    print(f"{'cp + sync':14s} {cp:9.2f} {size / cp / 1e9:7.3f} {1.0:6.2f} {'-':>13s}  "
          f"{[round(x, 2) for x in rows['cp']]}")
    result = {"file": str(src), "bytes": size, "machine": machine(), "cp_s": rows["cp"], "layouts": {}}
    for layout in a.layouts.split(","):
        t = median(rows[layout])
        print(f"{'pack ' + layout:14s} {t:9.2f} {size / t / 1e9:7.3f} {cp / t:6.2f} {rss[layout] / 2**20:13.0f}  "
              f"{[round(x, 2) for x in rows[layout]]}")
        result["layouts"][layout] = {"s": rows[layout], "ratio_vs_cp": cp / t, "peak_rss_bytes": rss[layout]}
    print(f"saved {save('pack', result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
