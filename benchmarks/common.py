"""Shared pieces of the benchmarks: shape-true model files, cold caches, child processes with
their peak RSS, medians. Benchmarks measure MawForge and its peer in the same run."""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from mawforge.bench.quick import llama_repack_off  # noqa: F401  (one copy; the benchmarks import it from here)

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "work" / "bench"          # git-ignored
PY = sys.executable


def machine() -> str:
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    mem = next(int(l.split()[1]) for l in open("/proc/meminfo") if l.startswith("MemTotal")) / 2**20
    return f"{platform.node()}: {os.cpu_count()} cores ({cpu}), {mem:.0f} GiB RAM, {platform.platform()}"


def drop_caches() -> None:
    """Cold page cache for the next read (root only; benchmarks run as root here)."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def run_child(cmd: list[str], *, env: dict | None = None, timeout: float = 3600, cwd=None) -> dict:
    """Run cmd; return wall seconds, exit code and output."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, **(env or {})},
                         cwd=cwd, text=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
    return {"wall_s": time.perf_counter() - t0, "rc": p.returncode, "stdout": out, "stderr": err}


def run_measured(cmd: list[str], **kw) -> dict:
    """Like run_child, but the peak RSS is the command's own (measured by a tiny wrapper)."""
    wrapper = [PY, "-c", _WRAP, *cmd]
    r = run_child(wrapper, **kw)
    lines = r["stderr"].rstrip().splitlines()
    if lines and lines[-1].startswith("MAXRSS "):
        r["peak_rss_bytes"] = int(lines[-1].split()[1]) * 1024
        r["stderr"] = "\n".join(lines[:-1])
    return r


_WRAP = r"""
import os, resource, subprocess, sys
p = subprocess.run(sys.argv[1:])
print("MAXRSS", resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)
sys.exit(p.returncode)
"""


def synth_model(layers: int, quant: str = "Q4_K_M", skew: float = 0.0, stickiness: float = 0.0,
                seed: int = 0, routing: str = "zipf") -> Path:
    """A shape-true Qwen3-30B-A3B-dimension GGUF under work/bench (built once); routing "real" is
    `synth --routing real` (skew and stickiness then do not apply)."""
    WORK.mkdir(parents=True, exist_ok=True)
    how = ["--skew", str(skew), "--stickiness", str(stickiness)] if routing == "zipf" else ["--routing", routing]
    name = (f"qwen3moe-L{layers}-{quant}-skew{skew:g}-stick{stickiness:g}-s{seed}.gguf" if routing == "zipf"
            else f"qwen3moe-L{layers}-{quant}-{routing}-s{seed}.gguf")
    out = WORK / name
    if not out.exists():
        r = run_child([PY, "-m", "mawforge.cli", "synth", "-o", str(out), "--layers", str(layers), "--quant", quant,
                       *how, "--seed", str(seed), "--no-report"])
        if r["rc"] != 0:
            raise SystemExit(f"synth failed: {r['stderr'][-2000:]}")
    return out


def fullsize_model(layers: int = 48, routing: str = "zipf") -> Path:
    """The full-size benchmarks' file: Zipf routing (skew 1.0, stickiness 0.3), or `--routing real`
    (routing calibrated to real text, docs/synth.md)."""
    return synth_model(layers, "Q4_K_M", skew=1.0, stickiness=0.3) if routing == "zipf" else \
        synth_model(layers, "Q4_K_M", routing=routing)


def pack_of(gguf: Path, layout: str = "exact", in_place: bool = False) -> Path:
    """The pack of a GGUF file (or the first shard of a set) beside it, made once: copied in `layout`,
    or in place (its experts read from the GGUF)."""
    stem = gguf.name.split("-00001-of-")[0].removesuffix(".gguf")
    out = gguf.parent / f"{stem}.{'inplace' if in_place else layout}.pack"
    if not (out / "manifest.json").exists():
        r = run_child([PY, "-m", "mawforge.cli", "pack", str(gguf), "-o", str(out), "--layout", layout,
                       "--quiet", "--force", *(["--in-place"] if in_place else [])])
        if r["rc"] != 0:
            raise SystemExit(f"pack failed: {r['stderr'][-2000:]}")
    return out


def worker_row(script: str, args: list[str], limit_bytes: int | None = None, timeout: float = 1800,
               env: dict | None = None) -> dict:
    """Run `script worker ARGS` on a dropped page cache (inside a cgroup v1 memory limit when
    limit_bytes is set); its last JSON line, plus exit status, peak RSS, wall time, cgroup stats."""
    cmd = [PY, os.path.abspath(script), "worker", *args]
    cg = None
    if limit_bytes:
        from mawforge.bench.cgroup import MemoryCgroup
        cg = MemoryCgroup(limit_bytes).__enter__()
        cmd = cg.wrap(cmd)
    try:
        drop_caches()
        r = run_measured(cmd, timeout=timeout, env=env)
        stats = cg.stats() if cg else {}
    finally:
        if cg:
            cg.close()
    lines = [l for l in r["stdout"].splitlines() if l.startswith("{")]
    row = json.loads(lines[-1]) if (r["rc"] == 0 and lines) else {}
    row.update(rc=r["rc"], peak_rss_bytes=r.get("peak_rss_bytes", 0), wall_s=r["wall_s"], cgroup=stats,
               status="ok" if r["rc"] == 0
               else ("killed (OOM)" if r["rc"] in (-9, 137, 247) else f"failed rc={r['rc']}"))
    if r["rc"] != 0:
        row["stderr_tail"] = r["stderr"][-600:]
    return row


def fill_args(n: int, decode: int = 10, warmup: int = 2) -> list[str]:
    """fullsize.py worker arguments for decode after n synthetic cached positions: one prompt token
    at position n, then `decode` teacher-forced steps (the first `warmup` not timed), no classes"""
    return ["--fill-context", str(n), "--prompt-tokens", "1", "--decode-tokens", str(decode), "--warmup", str(warmup),
            "--classes", ""]


def worker_parser(engines: tuple[str, ...]) -> argparse.ArgumentParser:
    """`SCRIPT worker ENGINE ...`: the arguments every benchmark worker takes (which file, which
    MawForge cache, llama.cpp's load, the prompt and decode lengths); scripts add their own."""
    ap = argparse.ArgumentParser()
    ap.add_argument("worker")
    ap.add_argument("engine", choices=engines)
    ap.add_argument("--model")
    ap.add_argument("--pack")
    ap.add_argument("--cache-percent", type=float)
    ap.add_argument("--budget-gib", type=float)
    ap.add_argument("--preload", action="store_true")
    ap.add_argument("--no-repack", action="store_true")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=4)
    return ap


def quiet(window_s: float = 1.0) -> dict:
    """The machine's quiet check: load averages and every other process that used more than 5% of
    a core over window_s (name, pid, share), read from /proc."""
    def cpu_times() -> dict[int, tuple[str, int]]:
        out = {}
        for d in Path("/proc").iterdir():
            if d.name.isdigit() and int(d.name) != os.getpid():
                try:
                    raw = (d / "stat").read_text()
                    name, rest = raw[raw.index("(") + 1:raw.rindex(")")], raw[raw.rindex(")") + 2:].split()
                    out[int(d.name)] = (name, int(rest[11]) + int(rest[12]))
                except (OSError, ValueError, IndexError):
                    continue
        return out
    a = cpu_times()
    time.sleep(window_s)
    b = cpu_times()
    tick = os.sysconf("SC_CLK_TCK")
    busy = [{"pid": pid, "name": name, "cpu_share": round((t - a[pid][1]) / tick / window_s, 3)}
            for pid, (name, t) in b.items() if pid in a and (t - a[pid][1]) / tick / window_s > 0.05]
    return {"loadavg": os.getloadavg(), "busy": busy}


# (family, model) -> the name RESULTS.md uses; others print as family/model
KNOWN_CPUS = {(25, 1): "AMD EPYC (Zen 3)", (25, 17): "AMD EPYC (Zen 4)", (26, 2): "AMD EPYC (Zen 5)",
              (6, 143): "Intel Xeon (Sapphire Rapids)", (6, 207): "Intel Xeon (Emerald Rapids)"}


def cpu_kind(cpuinfo: str | None = None) -> dict:
    """The CPU's vendor, family, model, name and AMX flag from /proc/cpuinfo's first processor."""
    if cpuinfo is None:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    first = cpuinfo.split("\n\n", 1)[0]
    f = {k.strip(): v.strip() for k, _, v in (ln.partition(":") for ln in first.splitlines()) if v}
    fam, mod = int(f.get("cpu family", -1)), int(f.get("model", -1))
    return {"family": fam, "model": mod, "model_name": f.get("model name", "?"),
            "amx": "amx_tile" in f.get("flags", "").split(),
            "kind": KNOWN_CPUS.get((fam, mod), f"{f.get('vendor_id', '?')} family {fam} model {mod}")}


def commit() -> str:
    r = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return r.stdout.strip() + ("+dirty" if dirty else "")


def median(xs) -> float:
    return statistics.median(xs) if xs else float("nan")


def finish_record(name: str, record: dict, keep: bool) -> Path:
    """The end of a benchmark: the quiet check after, the JSON under work/bench, and with keep (a
    script's --record) a copy as benchmarks/records/NAME-COMMIT.json. Returns the work/bench path."""
    record["quiet_after"] = quiet()
    path = save(name, record)
    print(f"record: {path}")
    if keep:
        out = ROOT / "benchmarks" / "records" / f"{name}-{record['commit'].split('+')[0]}.json"
        out.write_text(json.dumps(record, indent=1, default=str))
        print(f"record: {out}")
    return path


def save(name: str, data: dict) -> Path:
    WORK.mkdir(parents=True, exist_ok=True)
    p = WORK / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    p.write_text(json.dumps(data, indent=1, default=str))
    return p
