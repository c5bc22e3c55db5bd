"""`mawforge bench quick MODEL`: how fast is *my* model on *this* machine with less memory? In a few
minutes: decode tok/s and the time to the first token at three memory limits picked from the model
and the machine, llama.cpp beside it on the same file when llama-cpp-python is installed, a
Markdown table, a JSON record and a PNG plot (decode tok/s against the memory limit).

    mawforge bench quick MODEL.gguf|PACK [-o DIR] [--tokens 32] [--limits-gib 24,12,8] [--no-llama]

The limits (unless given): the whole model (its plan with every expert cached), and the plans with
half and a fifth of the experts cached (never below the plan's minimum), each with the margin the
default budget leaves to the page cache (8% of a limit, at least 256 MiB), capped by what this
machine has. Each row is one child process inside a cgroup v1 memory limit of that size (page cache
included; without cgroup v1 and root it runs with `--memory-budget-gib` alone and says so), on a
dropped page cache where it may drop it. MawForge runs `mawforge run` with its defaults; llama.cpp
its default load when the model fits, its mmap load (repack off) under a tighter limit, where its
default load would copy the weights. Both sample at temperature 1.0 from the same text prompt
(greedy decoding on random weights repeats one token); MawForge ignores end-of-text, llama.cpp's
row is timed over the tokens it generated. llama.cpp rows stop after --llama-timeout seconds (under
a limit it reads much of the model a token) and keep the rate of the tokens they had, marked
partial.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from mawforge.errors import MawError

help = "your model on this machine: decode and first-token time at three memory limits, llama.cpp beside it"
GiB = 2**30
MARGIN = 0.92          # plan.default_budget keeps 8% of a limit for the page cache and the kernel
CONTEXT = 1024
SLACK = 96 << 20       # beside the planned terms in each picked limit
PROMPT = ("A mixture-of-experts model routes each token to a few of its experts. Explain, step by step, how a "
          "runtime can keep the whole model on disk and still answer quickly when memory is scarce.")


def pick_limits(pack: Path, context: int = CONTEXT) -> list[tuple[str, int]]:
    """(label, bytes): the whole model, half and a fifth of its experts cached, within this machine.
    The framework term is this process's (torch and the runtime imported), as the child's will be,
    plus SLACK for what a child's first forward adds beyond it."""
    import mawforge.engine.runtime  # noqa: F401  (imported, so the measured framework is the child's)
    from mawforge.plan import PackFacts, framework_in_process, make_plan
    from mawforge.sysmem import DEFAULT_MARGIN_MIN, cgroup_limit, mem_available
    f = PackFacts.from_pack(pack)
    whole = make_plan(f, context=context, expert_cache_percent=100, framework_bytes=framework_in_process())
    base = whole.F - whole.E + SLACK
    limit = lambda need: int(max(need / MARGIN, need + DEFAULT_MARGIN_MIN))  # noqa: E731  (default_budget's margin)
    rows = [("whole", limit(base + whole.E * 1.05)),
            ("half the experts", limit(base + max(f.min_cache_bytes, whole.E // 2))),
            ("a fifth of the experts", limit(base + max(f.min_cache_bytes, whole.E // 5)))]
    caps = [x for x in (mem_available(), (cgroup_limit() or (None,))[0]) if x]
    have = min(caps) if caps else None
    return [(label, min(b, have) if have else b) for label, b in rows]


def _drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def _child(cmd: list[str], limit: int, timeout: float) -> dict:
    """Run cmd inside a memory cgroup of `limit` bytes (or without one); wall time, output, status."""
    from mawforge.bench import cgroup
    cg = cgroup.MemoryCgroup(limit).__enter__() if cgroup.available() else None
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cg.wrap(cmd) if cg else cmd, capture_output=True, text=True, timeout=timeout)
        out = {"rc": p.returncode, "stdout": p.stdout, "stderr": p.stderr}
    except subprocess.TimeoutExpired as e:     # what it printed so far is kept (llama.cpp's progress lines)
        text = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")  # noqa: E731
        out = {"rc": None, "stdout": text(e.stdout), "stderr": text(e.stderr), "timeout": True}
    finally:
        out_stats = cg.stats() if cg else {}
        if cg:
            cg.close()
    out.update(wall_s=time.perf_counter() - t0, cgroup=bool(cg), peak_bytes=out_stats.get("max_usage_bytes"))
    return out


def mawforge_row(pack: Path, limit: int, tokens: int, threads: int, timeout: float) -> dict:
    from mawforge.bench import cgroup
    cmd = [sys.executable, "-m", "mawforge.cli", "run", "--pack", str(pack), "--context", str(CONTEXT),
           "--max-tokens", str(tokens), "--temperature", "1.0", "--seed", "0", "--ignore-eos", "--telemetry-json",
           "--threads", str(threads), PROMPT]
    if not cgroup.available():
        cmd[5:5] = ["--memory-budget-gib", f"{limit * MARGIN / GiB:.3f}"]
    r = _child(cmd, limit, timeout)
    row = {"engine": "mawforge", "wall_s": r["wall_s"], "peak_bytes": r["peak_bytes"]}
    lines = [ln for ln in r["stderr"].splitlines() if ln.startswith("{")]
    if r["rc"] != 0 or not lines:
        return {**row, "status": "timeout" if r.get("timeout") else f"failed: {(r['stderr'] or '').strip()[-300:]}"}
    t = json.loads(lines[-1])
    return {**row, "status": "ok", "decode_tok_s": t["decode_tok_s"], "ttft_s": t["ttft_s"],
            "first_token_s": r["wall_s"] - t["decode_s"], "hit_rate": t["hit_rate"], "tokens": t["completion_tokens"]}


def llama_row(model: Path, limit: int, whole: bool, tokens: int, threads: int, timeout: float) -> dict:
    """llama.cpp's row; past the timeout it keeps what the worker printed (a decode rate from two
    tokens or more is still a rate, marked partial)."""
    cmd = [sys.executable, "-m", "mawforge.bench.quick", "llama-worker", str(model), str(tokens), str(threads),
           "default" if whole else "mmap"]
    t0 = time.time()
    r = _child(cmd, limit, timeout)
    row = {"engine": "llama.cpp", "load": "default" if whole else "mmap (repack off)", "wall_s": r["wall_s"],
           "peak_bytes": r["peak_bytes"]}
    lines = [json.loads(ln) for ln in r["stdout"].splitlines() if ln.startswith("{")]
    got = lines[-1] if lines else {}
    if got.get("tokens", 0) < 2 or (r["rc"] not in (0, None)):
        why = f"timeout after {timeout:g} s" if r.get("timeout") else \
            "killed (out of memory)" if r["rc"] in (-9, 137) else f"failed: {r['stderr'].strip()[-300:]}"
        return {**row, "status": why, **got}
    status = "ok" if r["rc"] == 0 else f"partial: {got['tokens']} tokens in {timeout:g} s"
    # from the process start as this process times it (the worker stamps wall-clock times), as MawForge's row
    return {**row, "status": status, **got, "first_token_s": got["first_token_at"] - t0}


def llama_repack_off() -> None:
    """Make llama-cpp-python load models without ggml's extra buffer types (the CPU repack of Q4_K
    and friends into interleaved layouts, a copy of the weights): the load that mmaps and can page."""
    import llama_cpp
    base = llama_cpp.llama_cpp.llama_model_default_params

    def params():
        p = base()
        p.use_extra_bufts = False
        return p
    llama_cpp.llama_cpp.llama_model_default_params = params


def llama_worker(model: str, tokens: int, threads: int, load: str) -> None:
    """One llama.cpp generation in this process (a child of `bench quick`); prints one JSON line."""
    import llama_cpp
    if load == "mmap":
        llama_repack_off()
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model, n_ctx=CONTEXT, n_threads=threads, n_threads_batch=threads, verbose=False, seed=0)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    first, n = None, 0

    def report(done: bool) -> None:           # after every token: a timed-out row keeps its progress
        now = time.perf_counter()
        print(json.dumps({"decode_tok_s": (n - 1) / (now - first) if n > 1 else 0.0, "ttft_s": first - t0,
                          "load_s": load_s, "first_token_at": first_wall, "tokens": n, "done": done}), flush=True)
    # no logit_bias against EOS: llama-cpp-python applies it in Python over the whole vocabulary each
    # token, which would slow llama.cpp's row; a model that ends early is timed over what it generated
    for chunk in llm.create_completion(PROMPT, max_tokens=tokens, temperature=1.0, stream=True):
        if chunk["choices"][0].get("finish_reason") is not None:
            break                             # the stream's closing chunk
        n += 1
        if first is None:
            first, first_wall = time.perf_counter(), time.time()
        report(False)
    report(True)


def table(rows: list[dict]) -> str:
    out = ["| memory limit | engine | decode tok/s | first token s (from start) | peak memory GiB | status |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        ok = r.get("decode_tok_s", 0) > 0 and r.get("tokens", 0) >= 2      # partial rows have a rate too
        peak = f"{r['peak_bytes'] / GiB:.2f}" if r.get("peak_bytes") else "-"
        speed = f"{r['decode_tok_s']:.2f} | {r['first_token_s']:.1f}" if ok else "- | -"
        where = f"{r['label']}: {r['limit_bytes'] / GiB:.2f} GiB"
        out.append(f"| {where} | {r['engine']} | {speed} | {peak} | {r['status']} |")
    return "\n".join(out)


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for engine, style in (("mawforge", "o-"), ("llama.cpp", "s--")):
        pts = sorted((r["limit_bytes"] / GiB, r["decode_tok_s"]) for r in rows
                     if r["engine"] == engine and r.get("decode_tok_s", 0) > 0)
        if pts:
            ax.plot(*zip(*pts), style, label="MawForge" if engine == "mawforge" else "llama.cpp")
    ax.set_xlabel("memory limit (GiB)")
    ax.set_ylabel("decode tok/s")
    ax.set_yscale("log")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="a GGUF file (or first shard), an HF directory or a pack")
    p.add_argument("-o", "--out", default=None, help="where the record, table and plot go (default: bench-quick-NAME)")
    p.add_argument("--tokens", type=int, default=32, help="tokens each row generates (sampled)")
    p.add_argument("--limits-gib", default=None, help="memory limits, comma-separated (default: picked, see above)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--no-llama", action="store_true", help="leave llama.cpp out even when it is installed")
    p.add_argument("--timeout", type=float, default=300, help="seconds a MawForge row may take")
    p.add_argument("--llama-timeout", type=float, default=45, help="seconds a llama.cpp row may take")


def main(a: argparse.Namespace) -> int:
    from mawforge.api import open_pack
    from mawforge.bench import cgroup
    model = Path(a.model)
    if a.tokens < 2:
        raise MawError("--tokens must be at least 2 (decode speed needs two tokens)")
    pack = open_pack(model, progress=sys.stderr.isatty())
    limits = pick_limits(pack)
    if a.limits_gib:
        try:
            limits = [(f"{g} GiB", int(float(g) * GiB)) for g in a.limits_gib.split(",")]
        except ValueError:
            raise MawError(f"--limits-gib takes numbers, got {a.limits_gib!r}") from None
    gguf = model if model.suffix == ".gguf" else None
    llama = None
    if gguf is not None and not a.no_llama:
        try:
            import llama_cpp  # noqa: F401
            llama = gguf
        except ImportError:
            pass
    out = Path(a.out or f"bench-quick-{model.name.removesuffix('.gguf')}")
    out.mkdir(parents=True, exist_ok=True)
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?") \
        if Path("/proc/cpuinfo").exists() else platform.processor()
    load0 = os.getloadavg()[0]
    print(f"mawforge bench quick: {model.name} on {cpu}, {a.threads} threads, {a.tokens} sampled tokens a row; "
          f"{'cgroup v1 memory limits' if cgroup.available() else 'NO cgroup (budgets only; page cache not limited)'}; "
          f"load average {load0:.2f}", file=sys.stderr)
    rows = []
    for i, (label, limit) in enumerate(limits):
        jobs = [("mawforge", lambda: mawforge_row(pack, limit, a.tokens, a.threads, a.timeout))]
        if llama is not None:
            jobs.append(("llama.cpp", lambda: llama_row(llama, limit, i == 0, a.tokens, a.threads, a.llama_timeout)))
        for _, job in (jobs if i % 2 == 0 else jobs[::-1]):          # engines alternate which goes first
            _drop_caches()
            r = {"label": label, "limit_bytes": limit, **job()}
            rows.append(r)
            print(f"  {label} ({limit / GiB:.2f} GiB) {r['engine']}: " +
                  (f"{r['decode_tok_s']:.2f} tok/s, first token {r['first_token_s']:.1f} s ({r['status']})"
                   if r.get("decode_tok_s", 0) > 0 else r["status"]), file=sys.stderr)
    record = {"benchmark": "bench-quick", "model": str(model), "pack": str(pack), "cpu": cpu, "threads": a.threads,
              "tokens": a.tokens, "decode": "sampled, temperature 1.0", "cgroup": cgroup.available(),
              "loadavg_before": load0, "loadavg_after": os.getloadavg()[0], "rows": rows}
    (out / "record.json").write_text(json.dumps(record, indent=1))
    md = table(rows)
    (out / "table.md").write_text(md + "\n")
    plot(rows, out / "decode_vs_memory.png", f"{model.name} on {cpu}")
    print(md)
    print(f"\nwrote {out / 'record.json'}, {out / 'table.md'}, {out / 'decode_vs_memory.png'}")
    return 0 if any(r["status"] == "ok" for r in rows if r["engine"] == "mawforge") else 1


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "llama-worker":
    llama_worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
