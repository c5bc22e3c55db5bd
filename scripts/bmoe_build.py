"""Build the peer engine BigMoeOnEdge (`bmoe-cli`, C++ on llama.cpp's public API) from source,
offline, so benchmarks can run it next to MawForge (benchmarks/bmoe.py is the adapter).

Sources, both already on this machine:
  - BigMoeOnEdge: HEAD of the bare git mirror $BMOE_MIRROR
    (default /work/.mirror/Helldez+BigMoeOnEdge/repo), via `git archive`. Its third_party/llama.cpp
    is a submodule (a fork branch adding an optional `--overlap` hook) and is not in the archive.
  - llama.cpp: `vendor/llama.cpp` of the pinned llama-cpp-python sdist (scripts/llama_wheel.py's
    sdist()), extracted to third_party/llama.cpp where BigMoeOnEdge's CMakeLists looks for it.
    Stock llama.cpp lacks the fork's expert-ready hook, so `--overlap` is unavailable (the
    CMake detects that itself); the serial streaming path `--moe-stream` is complete.

Patch (core/src/engine/session.cpp, applied as exact string edits that stop the build with a
clear message if the text moved): the vendored llama.cpp is newer than the one BigMoeOnEdge pins
and changed the `common_speculative` API its `--mtp` (multi-token prediction) path uses:
`common_speculative_process()` takes a `common_batch` instead of a `llama_batch`, and the draft
params' `n_past` is now `pos0`. Nothing else fails to compile. The `--mtp` path is compiled out:
the three process() calls go to a stub, `n_past` is renamed, and `--mtp` is refused before the
model loads. `--ngram` speculation, sampling and all of `--moe-stream` are untouched.

Build: CMake Release, CPU only (no CUDA/Metal/Vulkan/BLAS, no curl/OpenSSL), GGML_NATIVE=ON,
static libraries (so OUT/bin/bmoe-cli needs no library of the build tree), tests and tools off;
only the bmoe-cli target; 5.5 minutes at -j2 with Ninja on this 2-core host (more with Make or
under load). GGML_NATIVE means the binary is for this CPU: the stamp
OUT/bin/bmoe-cli.stamp.json records the BigMoeOnEdge commit, the sdist, the CMake arguments and a
hash of the CPU flags, and a run whose stamp matches prints the binary's path and exits.

    python scripts/bmoe_build.py [--out ~/.cache/mawforge/bmoe] [--jobs 2] [--force] [--keep-build]
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MIRROR = Path(os.environ.get("BMOE_MIRROR", "/work/.mirror/Helldez+BigMoeOnEdge/repo"))
BINARY = "bmoe-cli"
LLAMA_IN_SDIST = "vendor/llama.cpp/"
LLAMA_IN_BMOE = "third_party/llama.cpp"

CMAKE_ARGS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DBMOE_BUILD_CLI=ON", "-DBMOE_BUILD_TESTS=OFF",
    "-DBMOE_BUILD_TOOLS=OFF", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_NATIVE=ON", "-DGGML_CUDA=OFF",
    "-DGGML_METAL=OFF", "-DGGML_VULKAN=OFF", "-DGGML_BLAS=OFF", "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=OFF", "-DLLAMA_BUILD_SERVER=OFF",
)

_SESSION = "core/src/engine/session.cpp"
_STUB = """constexpr int mtp_draft_ubatch = 32;

// MawForge build patch (scripts/bmoe_build.py): the vendored llama.cpp's common_speculative_process()
// takes a common_batch, not a llama_batch, so the --mtp path is compiled out. --mtp is refused in
// Session::open before anything calls this.
[[maybe_unused]] static bool bmoe_mtp_process(common_speculative *, const llama_batch &) { return false; }
"""
# (file, name, old text, new text, expected occurrences of the old text)
PATCHES: tuple[tuple[str, str, str, str, int], ...] = (
    (_SESSION, "mtp stub", "constexpr int mtp_draft_ubatch = 32;\n", _STUB, 1),
    (_SESSION, "mtp process calls", "common_speculative_process(im.mtp.get(), ",
     "bmoe_mtp_process(im.mtp.get(), ", 3),
    (_SESSION, "draft params n_past -> pos0", "dp.n_past = n_past;", "dp.pos0 = n_past;", 1),
    (_SESSION, "refuse --mtp", "    mparams.load_mtp = cfg.spec.is_mtp();\n",
     "    if (cfg.spec.is_mtp())\n"
     "        return fail(\"--mtp is compiled out of this build (MawForge's bmoe_build.py: the \"\n"
     "                    \"vendored llama.cpp's common_speculative API differs); use --ngram\");\n"
     "    mparams.load_mtp = false;\n", 1),
)


def _llama_wheel():
    spec = importlib.util.spec_from_file_location("llama_wheel", HERE / "llama_wheel.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def git(*args: str) -> str:
    return subprocess.run(["git", f"--git-dir={MIRROR}", *args], check=True, capture_output=True,
                          text=True).stdout.strip()


def stamp_for(commit: str, sdist: Path, cpu: set[str]) -> dict:
    return {"bmoe_commit": commit, "sdist": sdist.name, "cmake_args": list(CMAKE_ARGS),
            "cpu_flags_sha": hashlib.sha256(" ".join(sorted(cpu)).encode()).hexdigest()[:16]}


def extract_bmoe(commit: str, dest: Path) -> None:
    tar = dest.parent / "bmoe.tar"
    subprocess.run(["git", f"--git-dir={MIRROR}", "archive", "-o", str(tar), commit], check=True)
    with tarfile.open(tar) as tf:
        tf.extractall(dest, filter="data")
    tar.unlink()


def extract_llama(sdist: Path, dest: Path) -> None:
    """vendor/llama.cpp of the sdist into dest, without its `.git` (a submodule pointer whose
    target is not in the sdist, which llama.cpp's build-info step would otherwise try to read)."""
    with tarfile.open(sdist) as tf:
        members = []
        for m in tf.getmembers():
            rest = m.name.split("/", 1)[-1]
            if rest.startswith(LLAMA_IN_SDIST) and ".git" not in rest[len(LLAMA_IN_SDIST):].split("/"):
                m.name = rest[len(LLAMA_IN_SDIST):]
                if m.name:
                    members.append(m)
        if not members:
            raise SystemExit(f"[bmoe_build] {sdist} has no {LLAMA_IN_SDIST}")
        dest.mkdir(parents=True, exist_ok=True)  # git archive leaves the submodule as an empty dir
        tf.extractall(dest, members=members, filter="data")


def apply_patches(src: Path, where: str) -> None:
    """All edits or none: every file is written only after every patch matched."""
    texts: dict[str, str] = {}
    for rel, name, old, new, count in PATCHES:
        text = texts.setdefault(rel, (src / rel).read_text())
        found = text.count(old)
        if found != count:
            raise SystemExit(f"[bmoe_build] patch '{name}' does not apply: expected {count} "
                             f"occurrence(s) of {old!r} in {rel}, found {found} ({where}). "
                             f"Update PATCHES in {Path(__file__).name}.")
        texts[rel] = text.replace(old, new)
    for rel, text in texts.items():
        (src / rel).write_text(text)


def check_self_contained(binary: Path, build: Path) -> None:
    ldd = subprocess.run(["ldd", str(binary)], capture_output=True, text=True).stdout
    bad = [l.strip() for l in ldd.splitlines() if "not found" in l or str(build) in l]
    if bad:
        raise SystemExit(f"[bmoe_build] {binary} needs libraries outside the system: {bad}")


def build(out: Path, jobs: int, force: bool, keep: bool) -> Path:
    lw = _llama_wheel()
    sdist = lw.sdist(str(Path(sys.executable).with_name("pip")))
    commit = git("rev-parse", "HEAD")
    want = stamp_for(commit, sdist, lw.cpu_flags())
    binary = out / "bin" / BINARY
    stamp = binary.with_name(BINARY + ".stamp.json")
    if not force and binary.exists() and stamp.exists() and \
            {k: v for k, v in json.loads(stamp.read_text()).items() if k in want} == want:
        return binary

    work = out / "build" / f"{commit[:12]}-{sdist.name.removesuffix('.tar.gz')}"
    shutil.rmtree(work, ignore_errors=True)
    src, bld = work / "src", work / "build"
    src.mkdir(parents=True)
    t0 = time.monotonic()
    print(f"[bmoe_build] BigMoeOnEdge {commit[:12]} + llama.cpp from {sdist.name} in {work} "
          f"(about 6 minutes at -j2)", flush=True)
    extract_bmoe(commit, src)
    extract_llama(sdist, src / LLAMA_IN_BMOE)
    apply_patches(src, f"BigMoeOnEdge {commit[:12]}, llama.cpp from {sdist.name}")
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    subprocess.run(["cmake", "-S", str(src), "-B", str(bld), *gen, *CMAKE_ARGS], check=True)
    subprocess.run(["cmake", "--build", str(bld), "--target", BINARY, "-j", str(jobs)], check=True)
    built = next(bld.rglob(BINARY), None)
    if built is None or not built.is_file():
        raise SystemExit(f"[bmoe_build] the build finished but no {BINARY} is under {bld}")
    check_self_contained(built, work)

    binary.parent.mkdir(parents=True, exist_ok=True)
    tmp = binary.with_name(BINARY + f".tmp-{os.getpid()}")
    shutil.copy2(built, tmp)
    version = subprocess.run([str(tmp), "--version"], capture_output=True, text=True, check=True)
    os.replace(tmp, binary)
    want.update(version=version.stdout.strip(), build_s=round(time.monotonic() - t0, 1))
    stamp.write_text(json.dumps(want, indent=1) + "\n")
    if not keep:
        shutil.rmtree(work, ignore_errors=True)
        with contextlib.suppress(OSError):
            work.parent.rmdir()
    print(f"[bmoe_build] built {binary} in {want['build_s']:.0f} s ({want['version']})", flush=True)
    return binary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=_llama_wheel().CACHE / "bmoe")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--force", action="store_true", help="rebuild even if the stamp matches")
    ap.add_argument("--keep-build", action="store_true", help="keep the source and build tree")
    a = ap.parse_args()
    print(build(a.out.expanduser(), a.jobs, a.force, a.keep_build))


if __name__ == "__main__":
    main()
