"""`mawforge run` shows prefill progress (tokens done, bytes read) when stderr is a terminal
(a pseudo-terminal here), and nothing beyond the telemetry line when stderr is a pipe."""
from __future__ import annotations

import os
import re
import select
import subprocess
import sys

import pytest
from helpers import dashboard_pack

PROMPT = " ".join(["the expert cache reads blocks from the pack when a layer routes to them"] * 6)


@pytest.fixture(scope="module")
def pack_dir(tmp_path_factory):
    return dashboard_pack(tmp_path_factory.mktemp("progress"))


def command(pack_dir) -> list[str]:
    return [sys.executable, "-m", "mawforge.cli", "run", "--pack", str(pack_dir), "--context", "512",
            "--expert-cache-percent", "30", "--threads", "1", "--prefill-chunk", "16", "--max-tokens", "2", PROMPT]


def prompt_tokens(stderr: str) -> int:
    m = re.search(r"\[telemetry\] prompt (\d+) tok", stderr)
    assert m, stderr
    return int(m.group(1))


def test_piped_stderr_gets_only_the_telemetry_line(pack_dir):
    r = subprocess.run(command(pack_dir), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert prompt_tokens(r.stderr) > 16 * 3                    # several prefill chunks ran
    assert r.stderr.splitlines() == [line for line in r.stderr.splitlines() if line.startswith("[telemetry]")]
    assert "prefill" not in r.stderr and "\r" not in r.stderr


def test_a_terminal_sees_tokens_done_and_bytes_read(pack_dir):
    master, slave = os.openpty()
    proc = subprocess.Popen(command(pack_dir), stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    seen = b""
    while True:
        if not select.select([master], [], [], 120)[0]:
            proc.kill()
            pytest.fail("mawforge run wrote nothing to its terminal for 120 s")
        try:
            data = os.read(master, 65536)
        except OSError:              # EIO: the child closed the terminal
            break
        if not data:
            break
        seen += data
    os.close(master)
    assert proc.wait(timeout=120) == 0
    proc.stdout.close()
    text = seen.decode(errors="replace")
    n = prompt_tokens(text)
    assert "prefill" in text
    done = [int(d) for d in re.findall(rf"(\d+)/{n} ", text)]
    assert done and max(done) == n and len(set(done)) >= 3     # tokens done, layer by layer through the wave
    read = [float(x) for x in re.findall(r"read ([0-9.]+) MiB", text)]
    assert read and max(read) > 0                               # and the expert bytes read so far


def test_run_preloads_when_the_plan_holds_every_expert(pack_dir):
    """With the whole model in the cache's budget `run` reads every expert in before the prompt (as
    `serve` does), so the request itself reads nothing; --no-preload reads them as routed; a cache
    of part of the experts starts empty."""
    import json

    def tele(*extra):
        cmd = [sys.executable, "-m", "mawforge.cli", "run", "--pack", str(pack_dir), "--context", "512",
               "--threads", "1", "--max-tokens", "3", "--telemetry-json", *extra, PROMPT]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        return json.loads([ln for ln in r.stderr.splitlines() if ln.startswith("{")][-1])
    warm = tele("--expert-cache-percent", "100")
    assert warm["misses"] == 0 and warm["materialized_bytes"] == 0 and warm["prefill_read_bytes"] == 0
    assert warm["hits"] > 0 and warm["expert_cache_held_bytes"] > 0
    cold = tele("--expert-cache-percent", "100", "--no-preload")
    assert cold["misses"] > 0 and cold["materialized_bytes"] > 0
    part = tele("--expert-cache-percent", "30")
    assert part["misses"] > 0
