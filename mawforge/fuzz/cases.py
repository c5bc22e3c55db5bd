"""What one fuzz case does, inside the forked child: copy a seed, mutate it, run the code
behind `inspect`, `pack` and `verify` on it, and say how that went.

Outcome classes (runner.py adds blowup and hang, which only the parent can see):
    clean     a MawError with a one-line message, or a verify report that names the damage
    accepted  every step succeeded (the mutation was harmless, or was not detected)
    crash     any other exception (a traceback a user would see), or a fresh pack failing verify
Flip cases (one byte flipped inside a digest-covered range of a valid pack):
    found     verify reported the pack damaged (or refused to read it)
    harmless  the flipped byte is in manifest.json and the parsed JSON is unchanged (whitespace)
    missed    verify said OK: a digest does not cover what it should
"""
from __future__ import annotations

import json
import random
import traceback
from pathlib import Path

from mawforge.errors import MawError
from mawforge.fuzz.mutators import MUTATORS, copy_seed

TARGET = {"gguf": "model.gguf", "hf": "model", "pack": "pack", "flip": "pack"}


def case_rng(master_seed: int, kind: str, i: int) -> random.Random:
    return random.Random(f"{master_seed}:{kind}:{i}")


def run_case(kind: str, seeds: dict[str, list[Path]], case_dir: Path, master_seed: int, i: int) -> dict:
    rng = case_rng(master_seed, kind, i)
    seed = rng.choice(seeds["pack" if kind == "flip" else kind])
    target = case_dir / TARGET[kind]
    copy_seed(seed, target)
    if kind == "flip":
        return _flip_case(target, rng)
    descs, names = [], []
    for _ in range(1 if rng.random() < 0.8 else 2):
        name = rng.choice(sorted(MUTATORS[kind]))
        names.append(name)
        try:
            descs.append(MUTATORS[kind][name](target, rng))
        except Exception as e:        # the mutator could not apply (an earlier edit removed its target)
            descs.append(f"{name} not applied ({type(e).__name__})")
    out = {"mutator": "+".join(names), "desc": "; ".join(descs)[:300]}
    try:
        out.update(_targets(kind, target, case_dir))
    except MawError as e:
        out.update({"class": "clean", "detail": str(e)[:300]})
        if "\n" in str(e):
            out.update({"class": "crash", "detail": "multi-line MawError: " + str(e)[:300]})
    except MemoryError as e:
        out.update({"class": "blowup", "detail": crash_detail(e)})
    except Exception as e:          # noqa: BLE001  (what a user would see as a traceback)
        out.update({"class": "crash", "detail": crash_detail(e)})
    return out


def _targets(kind: str, target: Path, case_dir: Path) -> dict:
    from mawforge.pack.inspect import describe
    from mawforge.pack.packer import pack
    from mawforge.pack.verify import verify
    describe(target)                                            # mawforge inspect
    if kind == "pack":
        rep = verify(target)                                    # mawforge verify
        return {"class": "accepted" if rep.ok else "clean", "detail": "; ".join(rep.lines()[1:3])[:300]}
    out = case_dir / "out.pack"
    pack(target, out, progress=False)                          # mawforge pack
    rep = verify(out)
    if not rep.ok:
        return {"class": "crash", "detail": "a pack just written fails verify: " + "; ".join(rep.lines())[:300]}
    describe(out)
    return {"class": "accepted", "detail": ""}


def _covered_ranges(pack: Path) -> list[tuple[str, int, int]]:
    """(file, offset, length) of every byte range a digest in the pack covers."""
    from mawforge.pack.manifest import COMMON, EXPERTS, INDEX, MANIFEST, read_index, read_manifest
    man, index = read_manifest(pack), read_index(pack)
    out = [(EXPERTS, off, lb.block_nbytes) for lb in index.layers for off in lb.offsets]
    out += [(COMMON, p.offset, p.nbytes) for t in man.common for p in t.parts]
    out += [(f, 0, (pack / f).stat().st_size) for f in man.tokenizer.get("files", [])]
    out += [(INDEX, 0, (pack / INDEX).stat().st_size), (MANIFEST, 0, (pack / MANIFEST).stat().st_size)]
    return [r for r in out if r[2] > 0]


def _flip_case(pack: Path, rng: random.Random) -> dict:
    from mawforge.pack.verify import verify
    ranges = _covered_ranges(pack)
    weights = [1.0 if f.endswith((".pack", ".bin")) else 0.5 for f, _, _ in ranges]
    f, off, n = rng.choices(ranges, weights)[0]
    at = off + rng.randrange(n)
    path = pack / f
    b = bytearray(path.read_bytes())
    before = bytes(b)
    b[at] ^= rng.randrange(1, 256)
    path.write_bytes(b)
    out = {"mutator": "flip", "desc": f"{f} byte {at} flipped"}
    try:
        rep = verify(pack)
    except MawError as e:
        return {**out, "class": "found", "detail": str(e)[:200]}
    if not rep.ok:
        return {**out, "class": "found", "detail": "; ".join(rep.lines()[1:3])[:200]}
    if f.endswith(".json") and _same_json(before, bytes(b)):
        return {**out, "class": "harmless", "detail": "parsed JSON unchanged"}
    return {**out, "class": "missed", "detail": "verify said OK"}


def _same_json(a: bytes, b: bytes) -> bool:
    try:
        return json.loads(a) == json.loads(b)
    except ValueError:
        return False


def crash_detail(e: BaseException) -> str:
    tb = traceback.extract_tb(e.__traceback__)[-3:]
    where = " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(tb))
    return f"{type(e).__name__}: {str(e)[:200]} at {where}"
