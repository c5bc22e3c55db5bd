"""Split GGUF models (`name-00001-of-0000N.gguf`, as llama.cpp and the hubs ship files over 50 GB):
pack, inspect, verify, plan, run and load() take the first shard, any shard or the directory, and
make what the single file makes; a missing, truncated or foreign shard is a one-line error naming it."""
import json
import shutil
from pathlib import Path

import pytest

import mawforge
from mawforge.demo import demo_gguf
from mawforge.errors import FormatError
from mawforge.fixtures.requant import split_gguf
from mawforge.formats.source import open_source
from mawforge.pack.inspect import describe
from mawforge.pack.packer import pack

from helpers import run_cli


@pytest.fixture(scope="module")
def single() -> Path:
    return Path(demo_gguf("Q4_K_M"))


@pytest.fixture(scope="module")
def shards(tmp_path_factory, single) -> list[Path]:
    fs = split_gguf(single, tmp_path_factory.mktemp("shards"), max_tensors=20)
    assert [f.name.rsplit("-", 3)[-3:] for f in fs] == [["00001", "of", "00003.gguf"], ["00002", "of", "00003.gguf"],
                                                       ["00003", "of", "00003.gguf"]]
    return fs


@pytest.fixture(scope="module")
def single_pack(tmp_path_factory, single) -> Path:
    out = tmp_path_factory.mktemp("p") / "single.pack"
    pack(single, out, progress=False)
    return out


@pytest.mark.parametrize("which", ["first", "last", "dir"])
def test_a_shard_set_packs_to_the_single_files_pack(tmp_path, shards, single_pack, which):
    given = {"first": shards[0], "last": shards[-1], "dir": shards[0].parent}[which]
    src = open_source(given)
    assert src.files == shards
    out = tmp_path / "sharded.pack"
    pack(given, out, progress=False)
    a, b = describe(out), describe(single_pack)
    assert a["pack_digest"] == b["pack_digest"]          # every byte and digest the same
    assert a["source"]["files"] == [f.name for f in shards]


def test_inspect_verify_plan_and_run_take_a_shard(tmp_path, shards):
    env = {"MAWFORGE_CACHE": str(tmp_path / "cache")}
    r = run_cli("inspect", str(shards[1]), "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["kind"] == "gguf" and d["layers"] == 4 and d["fallback_tensors"] == []
    r = run_cli("verify", str(shards[0].parent))
    assert r.returncode == 0 and "3 files" in r.stdout, r.stdout + r.stderr
    r = run_cli("plan", "--pack", str(shards[0]), "--memory-budget-gib", "1", "--context", "256", env=env)
    assert r.returncode == 0 and "FEASIBLE" in r.stdout, r.stderr
    r = run_cli("run", "--pack", str(shards[0].parent), "--context", "256", "--max-tokens", "4", "--threads", "1",
                "In the beginning", env=env)
    assert r.returncode == 0, r.stderr
    assert len(list((tmp_path / "cache" / "packs").iterdir())) == 1     # plan and run share the one pack


def test_load_of_a_shard_directory_generates_what_the_file_does(tmp_path, shards, single):
    outs = []
    for path in (single, shards[0].parent):
        with mawforge.load(path, context=256, cache_dir=tmp_path / "packs", threads=1) as m:
            outs.append([ev.token for ev in m.generate("And God said", max_tokens=8, temperature=0)])
    assert outs[0] == outs[1] and len(outs[0]) == 8


def _copy_set(shards, to: Path) -> list[Path]:
    to.mkdir()
    return [Path(shutil.copy(f, to / f.name)) for f in shards]


def test_a_missing_shard_is_named(tmp_path, shards):
    fs = _copy_set(shards, tmp_path / "m")
    fs[1].unlink()
    for given in (fs[0], fs[0].parent):
        with pytest.raises(FormatError, match=f"^{fs[1].name}: shard 2 of 3 is missing"):
            open_source(given)
    r = run_cli("pack", str(fs[0]), "-o", str(tmp_path / "out"))
    assert r.returncode != 0 and fs[1].name in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_a_truncated_shard_is_named(tmp_path, shards):
    fs = _copy_set(shards, tmp_path / "t")
    with open(fs[2], "r+b") as f:
        f.truncate(fs[2].stat().st_size - 4096)
    with pytest.raises(FormatError, match=f"^{fs[2].name} is truncated"):
        open_source(fs[0])


def test_a_shard_of_another_model_is_named(tmp_path, shards):
    # the Q8_0 file split otherwise: its second shard holds another number of tensors in all
    other = split_gguf(Path(demo_gguf("Q8_0")), tmp_path / "other", max_tensors=25)
    fs = _copy_set(shards, tmp_path / "f")
    shutil.copy(other[1], fs[1])
    with pytest.raises(FormatError, match=f"^{fs[1].name} and {fs[2].name} both hold tensor .*: shards of two models"):
        open_source(fs[0])
    # a shard renamed into another place of its own set
    fs2 = _copy_set(shards, tmp_path / "g")
    shutil.copy(shards[2], fs2[1])
    with pytest.raises(FormatError, match=f"^{fs2[1].name}: not shard 2 of this 3-shard model"):
        open_source(fs2[0])


def test_a_directory_of_two_models_is_refused(tmp_path, shards, single):
    fs = _copy_set(shards, tmp_path / "two")
    shutil.copy(single, fs[0].parent / "other.gguf")
    with pytest.raises(FormatError, match="exactly one file or one shard set"):
        open_source(fs[0].parent)
