"""Build (once per machine and CPU level) and install the llama-cpp-python wheel the tests and
benchmarks use as their oracle and peer, so that it runs on every CPU this project meets.

Why not `pip install llama-cpp-python`: pip compiles llama.cpp with GGML_NATIVE (-march=native)
and every x86 ISA extension the build host has, AMX included. On an AMX Xeon that build crashes
(SIGSEGV/SIGILL) in ggml's AMX repack path on every Q8_0/F16 file, and pip's wheel cache is keyed
by the sdist alone, so a wheel compiled for one CPU is reused on the next machine. Here the wheel
is compiled with GGML_NATIVE=OFF and an explicit ISA list (AVX-512 with VBMI/VNNI/BF16 where all
are present, else AVX2/FMA/F16C, else baseline), AMX always off; ggml's default CPU path,
weight repacking included, stays on. The wheel lives in
$MAWFORGE_CACHE/wheels/<version>-<key>/, key = hash of the version and CMAKE_ARGS, and pip's own
cache is bypassed, so no build for one ISA level is ever picked up on a CPU that lacks it.

    python scripts/llama_wheel.py [--pip PATH] [--print-args]
"""
from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
from pathlib import Path

VERSION = "0.3.36"
CACHE = Path(os.environ.get("MAWFORGE_CACHE", Path.home() / ".cache" / "mawforge"))

# ISA levels, best first: (name, required /proc/cpuinfo flags, cmake options)
LEVELS = (
    ("avx512", ("avx2", "fma", "f16c", "avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw",
                "avx512vbmi", "avx512_vnni", "avx512_bf16"),
     ("GGML_AVX", "GGML_AVX2", "GGML_FMA", "GGML_F16C", "GGML_AVX512", "GGML_AVX512_VBMI",
      "GGML_AVX512_VNNI", "GGML_AVX512_BF16")),
    ("avx2", ("avx", "avx2", "fma", "f16c"), ("GGML_AVX", "GGML_AVX2", "GGML_FMA", "GGML_F16C")),
    ("baseline", (), ()),
)
ALWAYS_OFF = ("GGML_NATIVE", "GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")


def cpu_flags() -> set[str]:
    try:
        line = next((l for l in open("/proc/cpuinfo") if l.startswith("flags")), "")
    except OSError:
        line = ""
    return set(line.split(":", 1)[-1].split())


def level(flags: set[str] | None = None) -> tuple[str, tuple[str, ...]]:
    flags = cpu_flags() if flags is None else flags
    forced = os.environ.get("MAWFORGE_LLAMA_LEVEL")
    for name, need, opts in LEVELS:
        if (forced == name) or (forced is None and set(need) <= flags):
            return name, opts
    raise SystemExit(f"MAWFORGE_LLAMA_LEVEL={forced!r} is not one of {[l[0] for l in LEVELS]}")


def cmake_args(opts: tuple[str, ...]) -> str:
    return " ".join([f"-D{o}=OFF" for o in ALWAYS_OFF] + [f"-D{o}=ON" for o in opts])


def wheel_dir(args: str) -> Path:
    key = hashlib.sha256(f"{VERSION} {args}".encode()).hexdigest()[:12]
    return CACHE / "wheels" / f"llama_cpp_python-{VERSION}-{key}"


def sdist(pip: str) -> Path:
    """The pinned sdist (also the source of llama.cpp's tokenizer vectors and chat templates)."""
    d = CACHE / "sdist"
    found = sorted(d.glob(f"llama_cpp_python-{VERSION}.tar.gz"))
    if not found:
        d.mkdir(parents=True, exist_ok=True)
        subprocess.run([pip, "download", "-q", "--no-deps", "--no-binary", ":all:", "-d", str(d),
                        f"llama-cpp-python=={VERSION}"], check=True)
        found = sorted(d.glob(f"llama_cpp_python-{VERSION}.tar.gz"))
    if not found:
        raise SystemExit(f"pip download gave no llama_cpp_python-{VERSION}.tar.gz in {d}")
    return found[0]


def ensure_wheel(pip: str) -> Path:
    name, opts = level()
    args = cmake_args(opts)
    out = wheel_dir(args)
    wheels = sorted(out.glob("llama_cpp_python-*.whl"))
    if wheels:
        return wheels[0]
    src = sdist(pip)
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    print(f"[llama_wheel] compiling llama-cpp-python {VERSION} for ISA level '{name}' "
          f"(about 7 minutes on 2 cores): CMAKE_ARGS={args}", flush=True)
    env = dict(os.environ, CMAKE_ARGS=args, FORCE_CMAKE="1")
    subprocess.run([pip, "wheel", "-q", "--no-cache-dir", "--no-deps", "-w", str(tmp), str(src)],
                   check=True, env=env)
    (tmp / "CMAKE_ARGS").write_text(args + "\n")
    os.replace(tmp, out)
    return sorted(out.glob("llama_cpp_python-*.whl"))[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pip", default=str(Path(sys.executable).with_name("pip")))
    ap.add_argument("--print-args", action="store_true", help="print the CMAKE_ARGS and exit")
    ap.add_argument("--sdist", action="store_true", help="fetch the sdist only and print its path")
    a = ap.parse_args()
    if a.print_args:
        name, opts = level()
        print(name, cmake_args(opts), wheel_dir(cmake_args(opts)))
        return
    if a.sdist:
        print(sdist(a.pip))
        return
    whl = ensure_wheel(a.pip)
    marker = Path(a.pip).resolve().parent.parent / "mawforge-llama-wheel.txt"
    if marker.exists() and marker.read_text().strip() == str(whl):
        return
    subprocess.run([a.pip, "install", "-q", "--force-reinstall", "--no-cache-dir", str(whl)],
                   check=True)
    marker.write_text(f"{whl}\n")
    print(f"[llama_wheel] installed {whl}")


if __name__ == "__main__":
    main()
