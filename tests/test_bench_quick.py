"""`mawforge bench quick MODEL`: the demo model at three memory limits picked from its plan, MawForge
and llama.cpp each in its own memory cgroup, a record, a table and a plot; `mawforge bench
MATRIX.yaml` still runs the matrix; bad input is one line. No speed is asserted."""
from __future__ import annotations

import json
import subprocess
import sys

from mawforge.bench.command import normalize
from mawforge.bench.quick import pick_limits
from mawforge.demo import demo_gguf


def cli(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "mawforge.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_quick_on_the_demo_model_writes_rows_table_and_plot(tmp_path):
    r = cli("bench", "quick", str(demo_gguf("Q4_K_M")), "-o", str(tmp_path / "q"), "--tokens", "4", "--threads", "1")
    assert r.returncode == 0, r.stderr[-2000:]
    rec = json.loads((tmp_path / "q" / "record.json").read_text())
    assert rec["decode"].startswith("sampled") and rec["cpu"]
    assert [x["engine"] for x in rec["rows"]].count("mawforge") == 3
    assert [x["engine"] for x in rec["rows"]].count("llama.cpp") == 3
    for row in rec["rows"]:
        assert row["status"] == "ok", row
        assert row["tokens"] == 4 if row["engine"] == "mawforge" else 2 <= row["tokens"] <= 4
        assert row["decode_tok_s"] > 0 and row["first_token_s"] > 0
    labels = [x["label"] for x in rec["rows"] if x["engine"] == "mawforge"]
    assert labels == ["whole", "half the experts", "a fifth of the experts"]
    table = (tmp_path / "q" / "table.md").read_text().splitlines()
    assert len(table) == 2 + 6 and "decode tok/s" in table[0] and table == r.stdout.strip().splitlines()[:8]
    assert (tmp_path / "q" / "decode_vs_memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_limits_shrink_with_the_share_of_experts_and_leave_the_default_margin():
    from mawforge.api import open_pack
    from mawforge.plan import Budget, PackFacts, make_plan
    pack = open_pack(demo_gguf("Q4_K_M"))
    (_, whole), (_, half), (_, fifth) = pick_limits(pack)
    assert whole >= half >= fifth > 0
    f = PackFacts.from_pack(pack)
    for limit in (whole, half, fifth):          # what the child's default budget will be, planned
        plan = make_plan(f, budget=Budget(limit - max(int(limit * 0.08), 256 << 20), "limit"), context=1024)
        assert plan.feasible, plan.reason


def test_bench_keeps_the_matrix_form_and_bad_input_is_one_line(tmp_path):
    assert normalize(["bench", "m.yaml", "-o", "x"]) == ["bench", "matrix", "m.yaml", "-o", "x"]
    assert normalize(["bench", "quick", "m.gguf"]) == ["bench", "quick", "m.gguf"]
    r = cli("bench", "quick", str(tmp_path / "missing.gguf"))
    assert r.returncode != 0 and "no such file" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = cli("bench", "quick", str(demo_gguf("Q4_K_M")), "--tokens", "1", "-o", str(tmp_path / "x"))
    assert r.returncode != 0 and "--tokens" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = cli("bench", str(tmp_path / "nope.yaml"), "--static-only")
    assert r.returncode != 0 and "nope.yaml" in r.stderr
