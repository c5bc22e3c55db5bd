"""Runs fuzz cases in forked children, each capped (RLIMIT_AS, wall-clock timeout), and
counts the outcomes. The parent imports the pack tools once and forks per case, so a case
costs milliseconds of start-up instead of an interpreter launch.

Classes the parent adds to cases.py's: blowup (MemoryError under the address-space cap, or
the child killed by the kernel) and hang (still running at the timeout; killed).

    python scripts/fuzz.py --cases 10000 --jobs 2 --out bench-runs/fuzz
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from mawforge.fuzz.cases import crash_detail, run_case

KINDS = ("gguf", "hf", "pack", "flip")
BAD = ("crash", "blowup", "hang", "missed")


def build_seeds(root: Path, archs: tuple[str, ...] = ("qwen3_moe",)) -> dict[str, list[Path]]:
    """Valid inputs from the fixture builders, built once under root: a tiny `mawforge synth`
    GGUF (llama.cpp's Q4_K_M quant mix, no transformers needed) and, per fixture arch, a
    Q4_K_M GGUF and the HF directory in both expert layouts; packs of the GGUFs and of the
    first HF layout."""
    from mawforge.synth import synth
    from mawforge.pack.packer import pack
    root.mkdir(parents=True, exist_ok=True)
    tiny = root / "synth-tiny.gguf"
    if not tiny.exists():
        synth(tiny, 2, vocab=1024, hidden=256, n_head=4, n_head_kv=2, head_dim=64, n_expert=8, n_expert_used=2,
              expert_ff=256, dense_ff=512, report=False, progress=False)
    sources = [("synth", "gguf", tiny)]
    if archs:
        from mawforge.fixtures.build import build_fixtures
        for arch, e in build_fixtures(root / "fixtures", archs=archs, ftypes=("Q4_K_M",)).items():
            sources += [(arch, "gguf", e["gguf"]["Q4_K_M"]), (arch, "hf", e["hf"]), (arch, "hf_fused", e["hf_fused"])]
    seeds: dict[str, list[Path]] = {"gguf": [], "hf": [], "pack": []}
    for arch, kind, path in sources:
        seeds["gguf" if kind == "gguf" else "hf"].append(path)
        if kind in ("gguf", "hf"):
            out = root / f"pack-{arch}-{kind}"
            if not (out / "manifest.json").exists():
                pack(path, out, progress=False, force=True)
            seeds["pack"].append(out)
    return seeds


def _child(kind, seeds, case_dir: Path, master_seed: int, i: int, mem_bytes: int) -> None:
    """Runs in the fork: never returns."""
    code = 0
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        resource.setrlimit(resource.RLIMIT_AS, (mem_bytes, mem_bytes))
        try:
            out = run_case(kind, seeds, case_dir, master_seed, i)
        except MemoryError as e:
            out = {"class": "blowup", "detail": crash_detail(e)}
        except BaseException as e:       # noqa: BLE001  (anything else a user would see as a traceback)
            out = {"class": "crash", "detail": crash_detail(e)}
        (case_dir / "result.json").write_text(json.dumps(out))
    except BaseException:                # noqa: BLE001
        code = 70
    os._exit(code)


class Fuzzer:
    def __init__(self, seeds: dict[str, list[Path]], work: Path, master_seed: int = 0, jobs: int = 2,
                 timeout_s: float = 20.0, mem_gib: float = 4.0, kinds: tuple[str, ...] = KINDS,
                 keep: Path | None = None):
        import mawforge.formats.gguf, mawforge.formats.hf, mawforge.pack.inspect, mawforge.pack.verify  # noqa: F401,E401
        # imported once here, not in every forked child (and not re-read from disk mid-run)
        self.seeds, self.work, self.master_seed, self.jobs = seeds, work, master_seed, jobs
        self.timeout_s, self.mem_bytes, self.kinds, self.keep = timeout_s, int(mem_gib * 2**30), kinds, keep

    def kind_of(self, i: int) -> str:
        return self.kinds[i % len(self.kinds)]

    def run(self, cases, on_result=None) -> list[dict]:
        """Run the given case numbers, at most `jobs` at a time; one result dict per case."""
        todo, running, results = list(cases), {}, []
        while todo or running:
            while todo and len(running) < self.jobs:
                i = todo.pop(0)
                kind, case_dir = self.kind_of(i), self.work / f"case-{i}"
                shutil.rmtree(case_dir, ignore_errors=True)
                case_dir.mkdir(parents=True)
                pid = os.fork()
                if pid == 0:
                    _child(kind, self.seeds, case_dir, self.master_seed, i, self.mem_bytes)
                running[pid] = (i, kind, case_dir, time.monotonic())
            time.sleep(0.005)
            for pid, (i, kind, case_dir, t0) in list(running.items()):
                done, status, usage = os.wait4(pid, os.WNOHANG)
                hung = not done and time.monotonic() - t0 > self.timeout_s
                if hung:
                    os.kill(pid, signal.SIGKILL)
                    _, status, usage = os.wait4(pid, 0)
                elif not done:
                    continue
                del running[pid]
                r = self._result(i, kind, case_dir, status, hung)
                r.update(wall_s=round(time.monotonic() - t0, 3), maxrss_mib=round(usage.ru_maxrss / 1024, 1))
                results.append(r)
                if on_result:
                    on_result(r)
                if self.keep is not None and r["class"] in BAD:
                    shutil.copytree(case_dir, self.keep / f"case-{i}", dirs_exist_ok=True)
                shutil.rmtree(case_dir, ignore_errors=True)
        return results

    def _result(self, i: int, kind: str, case_dir: Path, status: int, hung: bool) -> dict:
        base = {"case": i, "kind": kind}
        f = case_dir / "result.json"
        if hung:
            return {**base, "class": "hang", "detail": f"still running after {self.timeout_s} s"}
        if f.exists():
            return {**base, **json.loads(f.read_text())}
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            cls = "blowup" if sig == signal.SIGKILL else "crash"
            return {**base, "class": cls, "detail": f"killed by {signal.Signals(sig).name}"}
        return {**base, "class": "crash", "detail": f"child exited {os.WEXITSTATUS(status)} without a result"}


def summarize(results: list[dict]) -> dict:
    by = Counter(r["class"] for r in results)
    per_kind: dict[str, Counter] = {}
    for r in results:
        per_kind.setdefault(r["kind"], Counter())[r["class"]] += 1
    return {"cases": len(results), "classes": dict(sorted(by.items())),
            "by_kind": {k: dict(sorted(v.items())) for k, v in sorted(per_kind.items())},
            "bad": [r for r in results if r["class"] in BAD]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/fuzz.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=1000)
    ap.add_argument("--start", type=int, default=0, help="first case number (cases are numbered, replayable)")
    ap.add_argument("--only", type=int, nargs="*", help="run just these case numbers")
    ap.add_argument("--seed", type=int, default=0, help="master seed")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--timeout-s", type=float, default=20.0)
    ap.add_argument("--mem-gib", type=float, default=4.0, help="RLIMIT_AS of each case")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--archs", default="qwen3_moe", help="fixture architectures for the seeds")
    ap.add_argument("--seeds-dir", type=Path, default=Path("work/fuzz-seeds"))
    ap.add_argument("--out", type=Path, default=None, help="write results.jsonl and summary.json here "
                    "(and keep the inputs of bad cases under out/bad)")
    a = ap.parse_args(argv)
    seeds = build_seeds(a.seeds_dir, tuple(x for x in a.archs.split(",") if x))
    kinds = tuple(k for k in a.kinds.split(",") if seeds["pack" if k == "flip" else k])
    keep = None
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        keep = a.out / "bad"
    log = open(a.out / "results.jsonl", "w") if a.out else None
    t0, n = time.monotonic(), [0]

    def on_result(r):
        n[0] += 1
        if log:
            log.write(json.dumps(r) + "\n")
            log.flush()
        if r["class"] in BAD:
            print(f"case {r['case']} {r['kind']} {r['class']}: {r.get('desc', '')} -> {r['detail']}", flush=True)
        if n[0] % 500 == 0:
            print(f"... {n[0]} cases, {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="mawforge-fuzz-") as work:
        fz = Fuzzer(seeds, Path(work), a.seed, a.jobs, a.timeout_s, a.mem_gib, kinds, keep)
        cases = a.only if a.only else range(a.start, a.start + a.cases)
        results = fz.run(cases, on_result)
    s = summarize(results)
    s.update(wall_s=round(time.monotonic() - t0, 1), seed=a.seed, jobs=a.jobs, kinds=",".join(kinds), archs=a.archs)
    if a.out:
        (a.out / "summary.json").write_text(json.dumps({k: v for k, v in s.items() if k != "bad"}, indent=1))
        log.close()
    print(f"{s['cases']} cases in {s['wall_s']} s (seed {a.seed}, {a.jobs} jobs): "
          + ", ".join(f"{k} {v}" for k, v in s["classes"].items()))
    for k, v in s["by_kind"].items():
        print(f"  {k:5s} " + ", ".join(f"{c} {m}" for c, m in v.items()))
    return 1 if s["bad"] else 0
