"""A model larger than the machine: the shape-true gpt-oss-120b shard set (`mawforge synth --shape
gpt-oss --shards 3`, ~62 GB, MXFP4 experts) packed in place (no second copy) and served on this
machine with no cgroup and inside cgroup v1 limits, MawForge against llama.cpp (mmap, its default
load) on the same files in the same run, alternating the engines at each limit.

    python benchmarks/beyond_memory.py [--model FIRST_SHARD] [--limits none,16,8] [--record]

llama.cpp's default load repacks weights for its CPU kernels into anonymous memory; on a model larger
than the machine that allocation fails (for this file: a 58 GB CPU_REPACK buffer), so the first row
tries it once and the llama.cpp rows after it load with repack off, which maps the files (mmap)
and reads experts as page faults.

Each row is one child process on a dropped page cache: a 512-token prompt of random ids (its
prefill time is the first-token time), then teacher-forced decode of random ids (the first
--warmup steps untimed). "none" gives MawForge a budget of the machine's memory less a margin
(--machine-budget-gib) and llama.cpp the whole machine. MawForge reports its hit rate and bytes
read a token; llama.cpp's reads are page faults (the cgroup's counters say how much it paged).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from common import finish_record, PY, WORK, commit, cpu_kind, machine, pack_of, quiet, run_child, worker_row  # noqa: E402

GiB = 2**30
DECODE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "decode.py")


def oss_model(layers: int) -> Path:
    """The synthetic gpt-oss shard set under work/oss (built once); its first shard."""
    d = WORK.parent / "oss"
    first = d / f"gpt-oss-L{layers}-synth-00001-of-00003.gguf"
    if not first.exists():
        r = run_child([PY, "-m", "mawforge.cli", "synth", "--shape", "gpt-oss", "--shards", "3", "--skew", "1.0",
                       "--layers", str(layers), "-o", str(d / f"gpt-oss-L{layers}-synth.gguf"), "--force"])
        if r["rc"] != 0:
            raise SystemExit(f"synth failed: {r['stderr'][-2000:]}")
    return first


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, help="first shard of a GGUF shard set (default: the synthetic gpt-oss)")
    ap.add_argument("--layers", type=int, default=36, help="layers of the synthetic gpt-oss")
    ap.add_argument("--limits", default="none,16,8", help="'none' or GiB, comma-separated")
    ap.add_argument("--machine-budget-gib", type=float, default=20.0, help="MawForge's budget with no cgroup")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--llama-decode-tokens", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--engines", default="llama,maw")
    ap.add_argument("--record", action="store_true", help="also write the record to benchmarks/records/")
    a = ap.parse_args()
    first = a.model or oss_model(a.layers)
    pack = pack_of(first, in_place=True)
    from mawforge.formats.gguf import shard_paths
    files = shard_paths(first)
    size = sum(f.stat().st_size for f in files)
    cpu = cpu_kind()
    record = {"bench": "beyond_memory", "machine": machine(), "cpu": cpu, "commit": commit(),
              "model": first.name, "files": len(files), "file_bytes": size,
              "mem_total_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
              "tokens": "random ids: a prompt, then decode teacher-forced", "quiet_before": quiet(), "rows": []}
    print(f"# {first.name}: {len(files)} files, {size / 1e9:.1f} GB; {cpu['kind']}", flush=True)
    engines = a.engines.split(",")
    if "llama" in engines:       # llama.cpp's default load, once: does it load at all?
        r = worker_row(DECODE, ["llama", "--model", str(first), "--context", str(a.prompt_tokens + 64),
                                "--prompt-tokens", str(a.prompt_tokens), "--decode-tokens", str(a.llama_decode_tokens),
                                "--warmup", "1"], None, timeout=a.timeout)
        r.update(engine="llama.cpp default (repack on)", limit="none")
        r.pop("cgroup", None)
        record["rows"].append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "stderr_tail"}), flush=True)
    for i, lim in enumerate(a.limits.split(",")):
        limit = None if lim == "none" else int(float(lim) * GiB)
        order = engines if i % 2 == 0 else engines[::-1]        # alternate which engine goes first
        for eng in order:
            if eng == "llama":
                args = ["llama", "--no-repack", "--model", str(first), "--context", str(a.prompt_tokens + 64),
                        "--prompt-tokens", str(a.prompt_tokens), "--decode-tokens", str(a.llama_decode_tokens),
                        "--warmup", "1"]
            else:
                budget = a.machine_budget_gib if limit is None else limit / GiB * 0.92
                args = ["maw", "--pack", str(pack), "--budget-gib", f"{budget:.3f}", "--stream-embeddings",
                        "--context", str(a.prompt_tokens + 64), "--prefill-chunk", "128",
                        "--prompt-tokens", str(a.prompt_tokens), "--decode-tokens", str(a.decode_tokens),
                        "--warmup", str(a.warmup)]
            r = worker_row(DECODE, args, limit, timeout=a.timeout)
            r.update(engine="llama.cpp mmap (repack off)" if eng == "llama" else "mawforge in place", limit=lim)
            r.pop("cgroup", None)
            record["rows"].append(r)
            print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()
                              if k != "stderr_tail"}), flush=True)
    print(f"\n# beyond memory, {machine()}; {first.name} ({size / 1e9:.1f} GB)")
    print(report(record))
    finish_record("beyond_memory", record, a.record)
    return 0


def _why(r: dict) -> str:
    """A failed row's status, with llama.cpp's reason where its stderr gave one."""
    if "Failed to load model" in r.get("stderr_tail", ""):
        return "does not load" + (" (llama.cpp: unable to allocate CPU_REPACK buffer)"
                                  if r["engine"].startswith("llama.cpp default") else "")
    return r["status"]


def report(record: dict) -> str:
    """The Markdown table of one record: per limit, each engine's first token, decode, and the ratio."""
    lines = ["| memory | engine | first token (512-token prompt) s | decode tok/s | hit rate | read/token "
             "| peak RSS GiB (planned F) | decode ratio |",
             "|---|---|---|---|---|---|---|---|"]
    by = {}
    for r in record["rows"]:
        by.setdefault(r["limit"], {})[r["engine"]] = r
    for lim, rows in by.items():
        ll = rows.get("llama.cpp mmap (repack off)", {}).get("decode_tok_s")
        for eng, r in rows.items():
            name = "whole machine" if lim == "none" else f"{lim} GiB cgroup"
            dec = r.get("decode_tok_s")
            ratio = f"{dec / ll:.1f}x" if (eng == "mawforge in place" and dec and ll) else ""
            hit = f"{r['hit_rate'] * 100:.1f}%" if "hit_rate" in r else ""
            key = "read_bytes_per_token" if "read_bytes_per_token" in r else "materialized_bytes_per_token"
            rd = f"{r[key] / 1e6:.0f} MB" if key in r else ""
            rss = f"{r['peak_rss_bytes'] / GiB:.2f}"
            if "planned_F" in r:
                rss += f" ({r['planned_F'] / GiB:.2f})"
            last = ratio if eng == "mawforge in place" else ("" if r["status"] == "ok" else _why(r))
            ttft = r.get("ttft_s")
            lines.append(f"| {name} | {eng} | {'' if ttft is None else f'{ttft:.1f}'} | "
                         f"{'' if dec is None else f'{dec:.3f}'} | {hit} | {rd} | {rss} | {last} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
