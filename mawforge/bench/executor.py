"""Running one cell: start its server as a subprocess (inside a cgroup when asked), guard it,
send its rows over HTTP, stop it with SIGTERM, and write the evidence. Executors decide where
cells run: `local` (one after another here) or `ray` (one cell per node at a time).

A CellJob is plain data (it travels to Ray workers); run_cell(job, outdir) writes
cells/CELL/ and rows/ROW/ under outdir and returns the row summaries.
"""
from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from mawforge.bench.cgroup import MemoryCgroup
from mawforge.bench.evidence import write_json, write_jsonl
from mawforge.bench.guard import Guard, GuardLimits, kill_tree, summarize
from mawforge.errors import MawError

LISTEN = re.compile(r"listening on (http://\S+)")
REJECTED_EXIT = 4


class Engine:
    """How a cell's server is started; one subclass per engine name."""
    registry: dict[str, type["Engine"]] = {}
    name = ""

    def __init_subclass__(cls, name: str, **kw):
        super().__init_subclass__(**kw)
        cls.name = name
        Engine.registry[name] = cls

    @staticmethod
    def command(job: "CellJob", telemetry_log: Path) -> list[str]:
        raise NotImplementedError


class MawForgeEngine(Engine, name="mawforge"):
    @staticmethod
    def command(job, telemetry_log):
        cmd = [sys.executable, "-m", "mawforge.cli", "serve", "--pack", job.source, "--model-id", job.model,
               "--host", "127.0.0.1", "--port", "0", "--context", str(job.context),
               "--expert-cache-percent", f"{job.cache_percent:g}", "--max-tokens-default", str(job.max_tokens),
               "--no-speculative", "--no-dashboard", "--telemetry-log", str(telemetry_log)]
        # cells measure the serving runtime alone: no dashboard (its kept route traces, up to
        # 12 MiB, would be planned in O and so change every cell's F)
        if job.budget_gib is not None:
            cmd += ["--memory-budget-gib", f"{job.budget_gib:g}"]
        if job.threads:
            cmd += ["--threads", str(job.threads)]
        return cmd + list(job.extra_args)


class _BaselineEngine(Engine, name="_baseline"):
    engine = ""

    @classmethod
    def command(cls, job, telemetry_log):
        cmd = [sys.executable, "-m", "mawforge.bench.baselines", "--engine", cls.engine, "--model", job.source,
               "--model-id", job.model, "--port", "0", "--context", str(job.context),
               "--max-tokens-default", str(job.max_tokens)]
        return cmd + (["--threads", str(job.threads)] if job.threads else []) + cls.flags


class LlamaCppEngine(_BaselineEngine, name="llama_cpp"):
    engine, flags = "llama_cpp", []


class LlamaCppNoMmapEngine(_BaselineEngine, name="llama_cpp_nommap"):
    engine, flags = "llama_cpp", ["--no-mmap"]


class TransformersEngine(_BaselineEngine, name="transformers"):
    engine, flags = "transformers", []


@dataclass(frozen=True)
class CellJob:
    cell_id: str
    model: str
    engine: str
    source: str
    context: int
    cache_percent: float | None
    budget_gib: float | None
    rows: tuple[tuple[str, dict], ...]         # (row_id, request body) in order
    max_tokens: int = 96
    threads: int | None = None
    extra_args: tuple[str, ...] = ()
    limits: GuardLimits = GuardLimits()
    memory_limit_bytes: int | None = None
    start_timeout_s: float = 300.0
    request_timeout_s: float = 600.0
    shutdown_timeout_s: float = 60.0
    plan: dict | None = None
    row_meta: dict = field(default_factory=dict)   # row_id -> the row's matrix fields


def _post(url: str, body: dict, timeout_s: float) -> tuple[int | None, str, str | None]:
    """(HTTP status, body text, transport error)."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, r.read().decode(errors="replace"), None
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace"), None
    except (urllib.error.URLError, OSError) as e:
        return None, "", f"{type(e).__name__}: {e}"


def _get(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.read().decode(errors="replace")
    except (urllib.error.URLError, OSError):
        return None


def _wait_listening(proc: subprocess.Popen, stderr: Path, guard: Guard, timeout_s: float) -> str | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None and guard.tripped is None:
        m = LISTEN.search(stderr.read_text(errors="replace"))
        if m:
            return m.group(1)
        time.sleep(0.05)
    m = LISTEN.search(stderr.read_text(errors="replace"))
    return m.group(1) if m and proc.poll() is None else None


def _shutdown(proc: subprocess.Popen, timeout_s: float) -> tuple[int | None, bool]:
    """SIGTERM, wait; a server that does not stop in time is killed (not a clean shutdown)."""
    if proc.poll() is not None:
        return proc.returncode, False
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout_s), proc.returncode == 0
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        return proc.wait(), False


def _row_outcome(status: int | None, text: str, err: str | None) -> tuple[dict | None, dict | None, list[str]]:
    reasons, resp, tel = [], None, None
    if err is not None:
        reasons.append(f"request failed: {err}")
    elif status != 200:
        reasons.append(f"HTTP {status}")
    try:
        resp = json.loads(text) if text else None
    except json.JSONDecodeError:
        reasons.append("response is not JSON")
    if isinstance(resp, dict):
        tel = resp.get("telemetry")
        if not isinstance(tel, dict) or "completion_tokens" not in tel:
            reasons.append("no final telemetry in the response")
            tel = None
        elif int((resp.get("usage") or {}).get("completion_tokens", 0)) <= 0:
            reasons.append("zero completion tokens")
    return resp, tel, reasons


@contextlib.contextmanager
def _reaper(proc: subprocess.Popen):
    """The server runs in its own session (Ctrl-C must not reach it mid-measurement), so an
    interrupted or crashed bench kills its tree here instead of leaving it running."""
    try:
        yield
    except BaseException:
        kill_tree(proc.pid)
        proc.wait()
        raise


def run_cell(job: CellJob, outdir: Path) -> list[dict]:
    """Run one feasible cell; write its evidence; return one summary dict per row."""
    cell_dir = Path(outdir) / "cells" / job.cell_id
    cell_dir.mkdir(parents=True, exist_ok=True)
    out_log, err_log, tel_log = cell_dir / "stdout.log", cell_dir / "stderr.log", cell_dir / "telemetry.jsonl"
    tel_log.unlink(missing_ok=True)
    cmd = Engine.registry[job.engine].command(job, tel_log)
    cg = MemoryCgroup(job.memory_limit_bytes) if job.memory_limit_bytes else None
    results: dict[str, dict] = {}
    cell: dict = {"cell_id": job.cell_id, "command": cmd, "started": False}
    try:
        if cg is not None:
            cg.__enter__()
            cell["cgroup"] = {"path": str(cg.path), "limit_bytes": job.memory_limit_bytes}
        with open(out_log, "wb") as so, open(err_log, "wb") as se:
            t_start = time.time()
            proc = subprocess.Popen(cg.wrap(cmd) if cg else cmd, stdout=so, stderr=se, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
            with Guard(proc.pid, job.limits, cg.path if cg else None) as guard, _reaper(proc):
                url = _wait_listening(proc, err_log, guard, job.start_timeout_s)
                cell["started"], cell["url"], cell["start_s"] = url is not None, url, time.time() - t_start
                if url is not None:
                    endpoint = url + "/v1/chat/completions"
                    for row_id, body in job.rows:
                        if guard.tripped is not None or proc.poll() is not None:
                            break
                        t0 = time.time()
                        status, text, err = _post(endpoint, body, job.request_timeout_s)
                        results[row_id] = {"t0": t0, "t1": time.time(), "status": status, "text": text, "err": err}
                    cell["health"], cell["metrics"] = _get(url + "/health"), _get(url + "/metrics")
                rc, clean = _shutdown(proc, job.shutdown_timeout_s)
            cell.update(exit_code=rc, shutdown_clean=clean, rejected_by_server=rc == REJECTED_EXIT,
                        wall_s=time.time() - t_start)
        if not cell["started"]:
            tail = [ln for ln in err_log.read_text(errors="replace").splitlines() if ln.strip()]
            cell["stderr_tail"] = tail[-1][:300] if tail else ""
        if cg is not None:
            cell["cgroup"] = cg.stats()
    finally:
        if cg is not None:
            cg.close()
    mem = guard.summary()
    cell["memory"] = mem
    write_jsonl(cell_dir / "memory.jsonl", guard.samples)
    write_json(cell_dir / "cell.json", cell)
    return [_write_row(job, row_id, body, results.get(row_id), cell, guard, outdir) for row_id, body in job.rows]


def _write_row(job: CellJob, row_id: str, body: dict, res: dict | None, cell: dict, guard: Guard,
               outdir: Path) -> dict:
    d = Path(outdir) / "rows" / row_id
    d.mkdir(parents=True, exist_ok=True)
    write_json(d / "request.json", body)
    reasons, resp, tel = [], None, None
    if not cell["started"]:
        reasons.append(f"server did not start (exit {cell['exit_code']}): {cell.get('stderr_tail', '')}")
    if res is None and cell["started"]:
        reasons.append("not sent: the cell stopped first")
    samples = guard.samples if res is None else guard.window(res["t0"] - 0.3, res["t1"] + 0.3)
    if res is not None:
        (d / "response.raw").write_text(res["text"])
        resp, tel, more = _row_outcome(res["status"], res["text"], res["err"])
        reasons += more
        write_json(d / "response.json", {"http_status": res["status"], "error": res["err"], "body": resp})
        write_json(d / "telemetry.json", tel)
    if guard.tripped is not None:
        reasons.append(f"memory guard: {guard.tripped}")
    if not cell.get("shutdown_clean"):
        reasons.append(f"no clean shutdown (exit {cell.get('exit_code')})")
    oom = bool((cell.get("cgroup") or {}).get("oom_kill"))
    if oom:
        reasons.append(f"the cgroup's OOM killer stopped the server (limit {job.memory_limit_bytes} bytes)")
    write_jsonl(d / "memory.jsonl", samples)
    status = "guard" if guard.tripped else "oom" if oom else ("ok" if not reasons else "failed")
    summary = {**job.row_meta.get(row_id, {}), "row_id": row_id, "cell_id": job.cell_id, "status": status,
               "valid": not reasons, "reasons": reasons, "http_status": None if res is None else res["status"],
               "telemetry": tel, "memory": summarize(samples, guard.tripped, job.limits), "plan": job.plan,
               "wall_s": None if res is None else res["t1"] - res["t0"],
               "logs": {"stdout": f"cells/{job.cell_id}/stdout.log", "stderr": f"cells/{job.cell_id}/stderr.log"}}
    write_json(d / "summary.json", summary)
    return summary


# ---- executors ------------------------------------------------------------------------------

class Executor:
    registry: dict[str, type["Executor"]] = {}

    def __init_subclass__(cls, name: str, **kw):
        super().__init_subclass__(**kw)
        Executor.registry[name] = cls

    def run(self, jobs: list[CellJob], outdir: Path, on_done) -> None:
        raise NotImplementedError


class LocalExecutor(Executor, name="local"):
    def __init__(self, **_):
        pass

    def run(self, jobs, outdir, on_done):
        for job in jobs:
            on_done(job, run_cell(job, outdir))


def _files_under(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


class _CellRunner:
    """A Ray actor pinned to one node: it runs one cell at a time in a scratch directory there
    and returns the summaries and every evidence file, which the driver writes."""

    def run(self, job: CellJob) -> tuple[list[dict], dict[str, bytes]]:
        import shutil
        import tempfile
        tmp = Path(tempfile.mkdtemp(prefix="mawforge-bench-"))
        try:
            return run_cell(job, tmp), _files_under(tmp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


class RayExecutor(Executor, name="ray"):
    """Cells over an existing Ray cluster (address "auto" or ray://...; "local" starts a private
    one-node instance, for tests). Packs and sources must be at the same paths on every node."""

    def __init__(self, address: str | None = None, **_):
        try:
            import ray
        except ImportError:
            raise MawError("--executor ray needs the ray package (pip install ray)") from None
        self.ray, self.owned = ray, False
        if not ray.is_initialized():
            if address == "local":
                ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
            else:
                ray.init(address=address or "auto", log_to_driver=False)
            self.owned = True

    def run(self, jobs, outdir, on_done):
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        ray = self.ray
        nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
        actor_cls = ray.remote(num_cpus=0)(_CellRunner)
        actors = [actor_cls.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote()
                  for n in nodes]
        todo, running, running_job = list(jobs), {}, {}
        while todo or running:
            for a in actors:              # one cell per node: an actor gets a job only when idle
                if todo and a not in running.values():
                    job = todo.pop(0)
                    running[a.run.remote(job)] = a
                    running_job[id(a)] = job
            done, _ = ray.wait(list(running), num_returns=1)
            for ref in done:
                actor = running.pop(ref)
                summaries, files = ray.get(ref)
                for rel, data in files.items():
                    p = Path(outdir) / rel
                    p.parent.mkdir(parents=True, exist_ok=True)
                    p.write_bytes(data)
                on_done(running_job.pop(id(actor)), summaries)
        for a in actors:
            ray.kill(a)
        if self.owned:
            ray.shutdown()


def make_executor(name: str, **kw) -> Executor:
    if name not in Executor.registry:
        raise MawError(f"unknown executor {name!r}; known: {', '.join(Executor.registry)}")
    return Executor.registry[name](**kw)
