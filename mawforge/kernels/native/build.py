"""Compiling the native kernels' library: the C sources and the headers they include, compiled with
the system C compiler into a cache directory keyed by the sources, the flags, the compiler's version
and this CPU's feature flags (so a library built on one CPU is never loaded on another)."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# every source compiled into the one library (the cache key covers all of them)
SOURCES = tuple(Path(__file__).with_name(n) for n in ("kquant_gemm.c", "decode_step.c", "reader.c"))
# headers they include (in the cache key too)
HEADERS = tuple(Path(__file__).with_name(n) for n in ("quant_types.h", "iq_tables.h"))
# MAWFORGE_NATIVE_MARCH=x86-64 builds the portable scalar path (tests compare the two)
MARCHES = [os.environ["MAWFORGE_NATIVE_MARCH"]] if os.environ.get("MAWFORGE_NATIVE_MARCH") else ["native", "x86-64"]
BASE_FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=c11"]


def cpu_flags() -> str:
    """The flags line of /proc/cpuinfo (empty where there is none)."""
    try:
        return next((l for l in open("/proc/cpuinfo") if l.startswith("flags")), "")
    except OSError:
        return ""


def _compiler_version(cc: str) -> str:
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _report(msg: str) -> None:
    print(f"[mawforge] native kernels: {msg}", file=sys.stderr, flush=True)


def _compile(cc: str, march: str, cache: Path) -> tuple[Path | None, str]:
    """The cached library for this source, flags, compiler and CPU, compiled if missing.
    Returns (path, "") or (None, the compiler's message)."""
    flags = [*BASE_FLAGS, f"-march={march}"]
    key = hashlib.sha256(b"".join(s.read_bytes() for s in (*SOURCES, *HEADERS)) + " ".join(flags).encode()
                         + _compiler_version(cc).encode()
                         + cpu_flags().encode()).hexdigest()[:16]
    lib = cache / f"kquant_gemm-{key}.so"
    if lib.exists():
        return lib, ""
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        out = Path(tmp) / lib.name
        try:
            r = subprocess.run([cc, *flags, *map(str, SOURCES), "-o", str(out), "-lm"], capture_output=True, text=True)
        except OSError as e:
            return None, f"{cc}: {e}"
        if r.returncode != 0:
            return None, (r.stderr or r.stdout).strip()[-2000:]
        os.replace(out, lib)       # atomic: a concurrent builder sees all or nothing
    return lib, ""
