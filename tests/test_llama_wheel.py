"""The llama.cpp oracle is built to run on every CPU of this project: no -march=native, no AMX
(ggml's AMX repack path crashes on AMX Xeons), an ISA level chosen from the CPU's flags, and a
wheel keyed by its build flags so one CPU's build is never reused on a CPU that lacks them."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("llama_wheel", ROOT / "scripts" / "llama_wheel.py")
lw = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lw)

EPYC = set("fpu sse2 avx avx2 fma f16c avx512f avx512dq avx512cd avx512bw avx512vl avx512vbmi "
           "avx512_vnni avx512_bf16 avx512_vbmi2".split())
XEON = EPYC | {"amx_tile", "amx_int8", "amx_bf16", "avx_vnni"}
HASWELL = set("fpu sse2 avx avx2 fma f16c".split())


def test_levels_follow_the_cpu_and_never_enable_amx(monkeypatch):
    monkeypatch.delenv("MAWFORGE_LLAMA_LEVEL", raising=False)
    assert lw.level(EPYC)[0] == lw.level(XEON)[0] == "avx512"
    assert lw.level(HASWELL)[0] == "avx2"
    assert lw.level({"fpu", "sse2"})[0] == "baseline"
    for flags in (EPYC, XEON, HASWELL):
        args = lw.cmake_args(lw.level(flags)[1]).split()
        assert "-DGGML_NATIVE=OFF" in args
        assert {"-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"} <= set(args)
        assert not [a for a in args if "AMX" in a and a.endswith("=ON")]
    # the same build for both CPU kinds of this project, another one for an AVX2-only CPU
    key = lambda flags: lw.wheel_dir(lw.cmake_args(lw.level(flags)[1]))
    assert key(EPYC) == key(XEON) != key(HASWELL)


def test_a_forced_level_is_checked(monkeypatch):
    monkeypatch.setenv("MAWFORGE_LLAMA_LEVEL", "avx2")
    assert lw.level(EPYC)[0] == "avx2"
    monkeypatch.setenv("MAWFORGE_LLAMA_LEVEL", "sapphire")
    with pytest.raises(SystemExit, match="not one of"):
        lw.level(EPYC)


def test_the_installed_oracle_is_the_portable_build():
    """The llama_cpp the suite imports reports no AMX and keeps ggml's repack path (its default
    CPU path), and its wheel is the one scripts/llama_wheel.py built for this CPU's level."""
    code = "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"
    info = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "AMX_INT8 = 1" not in info and "AMX" not in info.replace("AMX_INT8 = 0", ""), info
    assert "REPACK = 1" in info, info
    name, opts = lw.level()
    if name == "avx512":
        assert "AVX512 = 1" in info, info
    marker = Path(sys.prefix) / "mawforge-llama-wheel.txt"
    assert marker.exists() and Path(marker.read_text().strip()).parent == lw.wheel_dir(lw.cmake_args(opts))
