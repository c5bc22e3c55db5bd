"""`mawforge bench` and `mawforge tune`: matrix expansion, static rejections, the memory guard,
cgroup limits, resume, evidence that parses, baselines, the tuner and the Ray executor, on the
tiny fixture packs (one feasible MawForge cell at most per run, max_tokens 8)."""
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from mawforge.bench import cgroup
from mawforge.bench.evidence import check_tree, load_summaries, read_jsonl, summary_table
from mawforge.bench.guard import Guard, GuardLimits
from mawforge.bench.matrix import bench, cell_jobs, static_stage
from mawforge.bench.prompts import CLASSES, PROMPTS, prompt_for
from mawforge.bench.spec import MatrixSpec, expand
from mawforge.bench.tune import Objective, Point, TuneSetup, coarse_points, refine_points, tune, write_config
from mawforge.errors import FormatError, MawError

BUDGET = 0.0035     # GiB: at context 256 the Q8_0 qwen3 fixture fits 10% cache (L 2.2 MB), not 50% (4.2 MB)
CTX = 256


@pytest.fixture(scope="module")
def q8(packs, fixtures_root):
    return packs[("qwen3_moe", "Q8_0")], fixtures_root["qwen3_moe"]["gguf"]["Q8_0"]


def small_spec(pack, gguf, **kw) -> MatrixSpec:
    d = {"name": "t", "budget_gib": BUDGET, "contexts": [CTX], "cache_points": [10, 50],
         "prompt_classes": ["code", "reasoning"], "repetitions": 1, "max_tokens": 8, "threads": 1,
         "models": [{"id": "q8", "pack": str(pack), "baselines": [{"engine": "llama_cpp", "source": str(gguf)}]}]}
    return MatrixSpec.from_dict(d | kw)


def test_prompt_suite_has_the_four_classes():
    assert set(CLASSES) == {"code", "summarization", "writing", "reasoning"}
    assert all(len(p) >= 2 for p in PROMPTS.values())
    assert prompt_for("code", 0) != prompt_for("code", 1) and prompt_for("code", 3) == prompt_for("code", 0)
    with pytest.raises(FormatError):
        prompt_for("poetry", 0)


def test_paper_matrix_expands_to_600_rows():
    spec = MatrixSpec.load(Path(__file__).parents[1] / "examples" / "matrix.yaml")
    spec = replace(spec, models=tuple(replace(m, baselines=()) for m in spec.models))
    rows = expand(spec)
    assert len(rows) == 3 * 5 * 2 * 4 * 5 == 600
    assert len({(r.model, r.context, r.cache_percent) for r in rows}) == 30
    assert len({r.row_id for r in rows}) == 600
    with_baselines = expand(MatrixSpec.load(Path(__file__).parents[1] / "examples" / "matrix.yaml"))
    assert len(with_baselines) == 600 + 4 * 2 * 4 * 5      # 4 baseline engines x 2 contexts x 4 classes x 5 reps


def test_matrix_file_errors_are_plain():
    with pytest.raises(FormatError, match="unknown matrix keys"):
        MatrixSpec.from_dict({"name": "x", "budget_gib": 1, "contexts": [8], "models": [], "colour": 1})
    with pytest.raises(FormatError, match="unknown baseline engine"):
        MatrixSpec.from_dict({"name": "x", "budget_gib": 1, "contexts": [8], "cache_points": [10],
                              "models": [{"id": "a", "pack": "p", "baselines": [{"engine": "vllm", "source": "s"}]}]})


def test_static_stage_counts_rejected_cells_as_rows(q8, tmp_path):
    spec = small_spec(*q8, repetitions=3)
    rows, plans = static_stage(spec, tmp_path)
    assert len(read_jsonl(tmp_path / "matrix.jsonl")) == len(rows) == 2 * 2 * 3 + 2 * 3
    decided = {k[2]: p["feasible"] for k, p in plans.items()}
    assert decided == {10.0: True, 50.0: False}
    res = bench(spec, tmp_path, static_only=True, report=False, log=lambda m: None)
    assert res.counts["rejected"] == 2 * 3 and all(r["valid"] for r in res.rows if r["status"] == "rejected")
    jobs = cell_jobs(spec, rows, plans, done=set())
    assert sorted(j.engine for j in jobs) == ["llama_cpp", "mawforge"]       # the rejected cell never runs


def test_guard_stops_a_process_tree_above_its_threshold():
    child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                              "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
                              "time.sleep(60)"],
                             start_new_session=True)
    with Guard(child.pid, GuardLimits(system_used=None, tree_rss_bytes=1 << 20), interval_s=0.05) as g:
        rc = child.wait(timeout=30)
    assert rc == -9 and g.tripped.startswith("tree_rss_bytes")
    s = g.summary()
    assert s["guard_tripped"] and s["samples"] >= 1 and s["max_tree_rss_bytes"] > 1 << 20
    with pytest.raises(FormatError):
        GuardLimits(system_used=1.5)


def test_end_to_end_matrix_with_rejection_baseline_and_resume(q8, tmp_path):
    spec = small_spec(*q8)
    out = tmp_path / "run"
    res = bench(spec, out, log=lambda m: None)
    assert res.counts == {"rows": 6, "valid": 6, "ok": 4, "rejected": 2}, [r["reasons"] for r in res.rows]
    assert check_tree(out) == []
    for name in ("manifest.json", "matrix.jsonl", "plans.jsonl", "rows.jsonl", "summary.csv", "report.md"):
        assert (out / name).exists(), name
    ok = [r for r in res.rows if r["status"] == "ok"]
    assert {r["engine"] for r in ok} == {"mawforge", "llama_cpp"}
    for r in ok:
        d = out / "rows" / r["row_id"]
        assert {p.name for p in d.iterdir()} >= {"request.json", "response.json", "telemetry.json", "memory.jsonl",
                                                 "summary.json"}
        assert r["telemetry"]["completion_tokens"] == 8 and r["memory"]["samples"] >= 1
    maw = next(r for r in ok if r["engine"] == "mawforge")
    assert maw["telemetry"]["schema"] == "mawforge.telemetry/1" and maw["plan"]["feasible"]
    cell = json.loads((out / "cells" / maw["cell_id"] / "cell.json").read_text())
    assert cell["started"] and cell["shutdown_clean"] and cell["exit_code"] == 0
    assert len(read_jsonl(out / "cells" / maw["cell_id"] / "telemetry.jsonl")) == 2   # the server's own log
    table = {(t["engine"], t["cache_percent"], t["prompt_class"]): t for t in summary_table(res.rows)}
    assert table[("mawforge", 10.0, "code")]["valid_runs"] == 1
    assert (out / "plots" / "planned-vs-rss.png").exists()
    assert "Static budget rejections | 1 unique cells, 2 matrix rows" in (out / "report.md").read_text()

    # resume: nothing to run; then one damaged row runs again, alone
    logs = []
    again = bench(spec, out, log=logs.append, report=False)
    assert any("0 cells to run" in m for m in logs) and again.counts == res.counts
    victim = out / "rows" / maw["row_id"] / "summary.json"
    victim.write_text(json.dumps(json.loads(victim.read_text()) | {"valid": False}))
    rows, plans = static_stage(spec, out)
    done = {k for k, s in load_summaries(out).items() if s["valid"]}
    (job,) = cell_jobs(spec, rows, plans, done)
    assert [rid for rid, _ in job.rows] == [maw["row_id"]]
    assert bench(spec, out, log=lambda m: None, report=False).counts == res.counts


def test_guard_trip_marks_the_rows(q8, tmp_path):
    spec = small_spec(*q8, guard={"system_used": 0.001}, prompt_classes=["code"], cache_points=[10],
                      models=[{"id": "q8", "pack": str(q8[0])}])
    res = bench(spec, tmp_path, log=lambda m: None, report=False)
    (row,) = res.rows
    assert row["status"] == "guard" and not row["valid"]
    assert any(r.startswith("memory guard: system_used_ratio") for r in row["reasons"])
    assert row["memory"]["guard_tripped"] and check_tree(tmp_path) == []


def test_cells_refuse_plainly_when_no_memory_cgroup_can_be_made(q8, tmp_path, monkeypatch):
    """Without a writable cgroup v1 memory controller (not root, cgroup v2, a container) a cell
    with a memory limit is refused with a one-line reason, not run unlimited. Simulated here by
    pointing this process's group at a path under a regular file, so it runs on every host."""
    spec = small_spec(*q8, prompt_classes=["code"], memory_limit_gib=1.0,
                      models=[{"id": "q8", "baselines": [{"engine": "llama_cpp_nommap", "source": str(q8[1])}]}])
    blocker = tmp_path / "not-a-cgroup"
    blocker.write_text("")
    monkeypatch.setattr(cgroup, "own_group", lambda root=cgroup.ROOT: blocker / "memory")
    with pytest.raises(MawError, match="cannot create a memory cgroup"):
        bench(spec, tmp_path / "run", log=lambda m: None, report=False)


@pytest.mark.skipif(not cgroup.available(), reason="needs a writable cgroup v1 memory controller (root)")
def test_cells_run_inside_a_cgroup_limit(q8, tmp_path):
    spec = small_spec(*q8, prompt_classes=["code"], memory_limit_gib=1.0,
                      models=[{"id": "q8", "baselines": [{"engine": "llama_cpp_nommap", "source": str(q8[1])}]}])
    stale = cgroup.own_group() / f"{cgroup.PREFIX}999999999-0"    # a group left by a crashed run
    stale.mkdir()
    res = bench(spec, tmp_path, log=lambda m: None, report=False)
    assert not stale.exists()
    (row,) = res.rows
    assert row["valid"], row["reasons"]
    cg = json.loads((tmp_path / "cells" / row["cell_id"] / "cell.json").read_text())["cgroup"]
    assert cg["limit_bytes"] == 1 << 30 and cg["max_usage_bytes"] > 0 and cg["oom_kill"] == 0
    assert row["memory"]["max_cgroup_usage_bytes"] > 0
    assert not list(cgroup.own_group().glob(f"{cgroup.PREFIX}{os.getpid()}-*"))


def test_objectives_pick_by_latency_not_hit_rate():
    pt = lambda p, dec, ttft, hit: Point(p, 1, dec, ttft, hit, 0.0, None, 0)
    curve = [pt(10, 9.0, 1.0, 0.5), pt(30, 14.0, 1.2, 0.8), pt(50, 20.0, 5.0, 0.95), pt(70, 2.0, 9.0, 0.99)]
    best = lambda obj: max((p for p in curve if obj.score(p, curve) is not None), key=lambda p: obj.score(p, curve))
    assert best(Objective.registry["decode"]()).cache_percent == 30          # 50% breaks the 1.5 x TTFT bound
    assert best(Objective.registry["decode"](ttft_bound_s=6.0)).cache_percent == 50
    assert best(Objective.registry["ttft"]()).cache_percent == 10
    assert coarse_points(5.0, 45.0, 5) == [5.0, 15.0, 25.0, 35.0, 45.0]
    assert refine_points(curve, 30, 1.0) == [20.0, 40.0]


def test_tune_measures_the_curve_and_writes_a_config(q8, tmp_path):
    setup = TuneSetup(str(q8[0]), BUDGET, CTX, classes=("code",), max_tokens=4, threads=1)
    res = tune(setup, tmp_path, Objective.registry["decode"](), points=2, rounds=0, log=lambda m: None)
    lo, hi = res["feasible_range"]
    assert [p["cache_percent"] for p in res["curve"]] == [lo, hi] and 0 < lo < hi < 50
    assert all(p["valid_runs"] == 1 for p in res["curve"])
    assert res["serve"]["expert_cache_percent"] in (lo, hi) and res["serve"]["context"] == CTX
    write_config(res, tmp_path / "tune.yaml")
    import yaml
    assert yaml.safe_load((tmp_path / "tune.yaml").read_text())["serve"] == res["serve"]
    assert check_tree(tmp_path) == []


def test_ray_executor_gathers_evidence_at_the_driver(q8, fixtures_root, tmp_path, monkeypatch):
    """One transformers baseline cell (the HF source) on a private Ray instance."""
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    hf = fixtures_root["qwen3_moe"]["hf"]
    spec = small_spec(*q8, prompt_classes=["code"], cache_points=[50],
                      models=[{"id": "q8", "pack": str(q8[0]),
                               "baselines": [{"engine": "transformers", "source": str(hf)}]}])
    res = bench(spec, tmp_path, executor="ray", ray_address="local", log=lambda m: None, report=False)
    assert res.counts == {"rows": 2, "valid": 2, "rejected": 1, "ok": 1}, [r["reasons"] for r in res.rows]
    ok = next(r for r in res.rows if r["status"] == "ok")
    assert ok["telemetry"]["schema"] == "mawforge.baseline/1" and ok["telemetry"]["completion_tokens"] == 8
    assert (tmp_path / "rows" / ok["row_id"] / "response.json").exists()
    assert (tmp_path / "cells" / ok["cell_id"] / "memory.jsonl").exists() and check_tree(tmp_path) == []
