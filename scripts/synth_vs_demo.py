"""How far `mawforge synth` routing is from the trained demo model's, per layer: prints the
markdown table docs/synth.md quotes.

    python scripts/synth_vs_demo.py [--shape-true] [--tokens 128] [--out DIR]

Default: synthetic files with the demo model's own dimensions (16 experts, top-2, 4 layers),
so popularity and overlap compare directly. --shape-true: Qwen3-30B-A3B dimensions (128
experts, top-8) with as many layers as the profile, popularity carried by the profile's
Lorenz curve (mawforge.synth.routing_profile). Each file is probed by the routing probe
(numpy forward on random tokens); the trained figures are on held-out text.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from mawforge.demo import ROUTING_PROFILE
from mawforge.synth.routing_profile import load_profile
from mawforge.synth import synth

DEMO_DIMS = dict(hidden=256, n_head=4, n_head_kv=2, head_dim=64, expert_ff=256)
VARIANTS = {"plain": {}, "profile": {"profile": True}, "profile + stickiness 0.3": {"profile": True, "stickiness": 0.3}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape-true", action="store_true")
    p.add_argument("--tokens", type=int, default=128, help="tokens the routing probe runs per file")
    p.add_argument("--out", type=Path, default=None, help="keep the files here (default: a temp dir)")
    a = p.parse_args(argv)
    prof = load_profile(ROUTING_PROFILE)
    dims = {} if a.shape_true else DEMO_DIMS | {"n_expert": prof.n_experts, "n_expert_used": prof.top_k}
    out = a.out or Path(tempfile.mkdtemp(prefix="synth_vs_demo_"))
    out.mkdir(parents=True, exist_ok=True)
    got = {}
    for name, v in VARIANTS.items():
        path = out / (name.replace(" ", "").replace("+", "_") + ".gguf")
        synth(path, len(prof.layers), vocab=2000 if not a.shape_true else 151936, progress=False,
              report_tokens=a.tokens, stickiness=v.get("stickiness", 0.0),
              routing_profile=prof if v.get("profile") else None, **dims)
        got[name] = json.loads(Path(str(path) + ".routing.json").read_text())
    print("| layer | model | entropy | top expert share | overlap | independent | locality |")
    print("|---|---|---|---|---|---|---|")
    for i, la in enumerate(prof.layers):
        print(f"| {i} | trained (held-out text) | {la.entropy:.3f} | {la.inclusion[0] / prof.top_k:.3f} | "
              f"{la.overlap:.3f} | {la.overlap_if_independent:.3f} | {la.locality:.3f} |")
        for name, r in got.items():
            x = r["layers"][i]
            ind = x["overlap_if_independent"]
            loc = (x["overlap"] - ind) / max(1e-9, 1 - ind)
            print(f"| {i} | synth {name} | {x['entropy']:.3f} | {x['top_expert_share']:.3f} | {x['overlap']:.3f} | "
                  f"{ind:.3f} | {loc:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
