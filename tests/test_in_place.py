"""In-place packs (`pack --in-place`, and load()'s default for a GGUF): no experts.pack; each
expert tensor is read from the source GGUF (or its shards) where it lies, through a page-aligned
superset read moved down into the slot. The blocks, tokens and logits equal the copied pack's; a
source edited, truncated or moved after packing is a one-line error naming the file (or, from
`verify`, the tensor), never silent output."""
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

import mawforge
from mawforge.cache.store import ExpertStore, SlotMemory
from mawforge.demo import demo_gguf
from mawforge.engine.runtime import Runtime, RuntimeOptions
from mawforge.errors import FormatError, IntegrityError
from mawforge.fixtures.requant import split_gguf
from mawforge.formats.source import open_source
from mawforge.pack.inspect import describe, table
from mawforge.pack.manifest import EXPERTS, read_index
from mawforge.pack.packer import pack
from mawforge.pack.verify import verify

from helpers import run_cli


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """A private copy of the demo GGUF (tests below edit their own copies of it)."""
    d = tmp_path_factory.mktemp("src")
    return Path(shutil.copy(demo_gguf("Q4_K_M"), d / "demo.gguf"))


@pytest.fixture(scope="module")
def copied(tmp_path_factory, model) -> Path:
    out = tmp_path_factory.mktemp("c") / "copied.pack"
    pack(model, out, progress=False)
    return out


@pytest.fixture(scope="module")
def in_place(tmp_path_factory, model) -> Path:
    out = tmp_path_factory.mktemp("i") / "inplace.pack"
    pack(model, out, progress=False, in_place=True)
    return out


def _parts(store: ExpertStore, layer: int, expert: int) -> list[bytes]:
    lb = store.index.layers[layer]
    mem = SlotMemory(lb.slot_nbytes)
    store.submit(layer, expert, mem.buf).result()
    out = [bytes(mem.host[p.offset:p.offset + p.nbytes].numpy()) for t in lb.tensors for p in t.parts]
    mem.close()
    return out


def test_an_in_place_pack_holds_no_expert_copy_and_names_its_sources(in_place, copied, model):
    assert not (in_place / EXPERTS).exists()
    index = read_index(in_place)
    assert index.in_place and [f.name for f in index.files] == [model.name]
    assert index.files[0].size == model.stat().st_size
    size = sum(f.stat().st_size for f in in_place.iterdir())
    assert size < sum(f.stat().st_size for f in copied.iterdir()) / 2
    man = json.loads((in_place / "manifest.json").read_text())
    assert man["source"]["in_place"] is True and man["bytes"]["experts_file"] == 0
    d = describe(in_place)
    assert d["in_place_files"] == [model.name] and d["expert_bytes"] == describe(model)["expert_bytes"]
    assert re.search(rf"experts read in place from +{model.name}\n", table(d))
    # the tensors' source offsets are not page-aligned: every read goes through a superset
    heads = {off % 4096 for lb in index.layers for r in lb.sources for off in r.offsets}
    assert len(heads) > 1


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("native_reads", [True, False])
def test_every_block_reads_the_copied_packs_bytes(in_place, copied, direct, native_reads):
    a = ExpertStore(in_place, read_index(in_place), direct=direct, native_reads=native_reads)
    b = ExpertStore(copied, read_index(copied))
    try:
        for layer, lb in enumerate(a.index.layers):
            for e in range(len(lb.offsets)):
                assert _parts(a, layer, e) == _parts(b, layer, e), (layer, e)
        assert a.bytes_read == sum(t.parts[0].nbytes for lb in a.index.layers for t in lb.tensors
                                   for _ in lb.offsets)
    finally:
        a.close()
        b.close()


def test_tokens_and_logits_equal_the_copied_packs(in_place, copied):
    outs = []
    for p in (in_place, copied):
        with mawforge.load(p, context=256, threads=1, expert_cache_percent=40) as m:
            toks = [ev.token for ev in m.generate("In the beginning God created", max_tokens=12, temperature=0)]
        rt = Runtime(p, RuntimeOptions(context=256, expert_cache_percent=40, threads=1))
        try:
            logits = rt.forward(rt.tokenizer.encode("And the earth was without form"), all_logits=True).numpy()
        finally:
            rt.close()
        outs.append((toks, logits))
    assert outs[0][0] == outs[1][0] and len(outs[0][0]) == 12
    np.testing.assert_array_equal(outs[0][1], outs[1][1])


def test_verify_names_the_tensor_an_edit_changed_and_a_run_refuses_it(tmp_path, model):
    src = Path(shutil.copy(model, tmp_path / "m.gguf"))
    out = tmp_path / "p"
    pack(src, out, progress=False, in_place=True)
    assert verify(out).ok
    index = read_index(out)
    r = index.layers[2].sources[1]                 # layer 2's second expert tensor, expert 3
    with open(src, "r+b") as f:
        f.seek(r.offsets[3] + 100)
        b = f.read(1)
        f.seek(r.offsets[3] + 100)
        f.write(bytes([b[0] ^ 0xFF]))
    rep = verify(out)
    assert not rep.ok and rep.damaged_blocks == [(2, 3)]
    assert any(r.tensor in p and src.name in p and "changed since" in p for p in rep.problems), rep.problems
    assert r.tensor == "blk.2.ffn_up_exps.weight"
    store = ExpertStore(out, index)
    try:
        with pytest.raises(IntegrityError,
                           match=f"layer 2 expert 3 differs from when it was packed: its source {src.name}"):
            store.submit(2, 3, SlotMemory(index.layers[2].slot_nbytes).buf).result()
    finally:
        store.close()
    r = run_cli("verify", str(out))
    assert r.returncode != 0 and "blk.2.ffn_up_exps.weight" in r.stdout


def test_a_truncated_moved_or_deleted_source_is_one_line_naming_it(tmp_path, model):
    src = Path(shutil.copy(model, tmp_path / "m.gguf"))
    out = tmp_path / "packs" / "p"
    pack(src, out, progress=False, in_place=True)
    with open(src, "r+b") as f:
        f.truncate(src.stat().st_size - 4096)
    with pytest.raises(IntegrityError,
                       match=f"^{src} has .* bytes, .* when p was packed in place from it: the source changed"):
        mawforge.load(out, context=128, threads=1)
    rep = verify(out)
    assert not rep.ok and any("m.gguf" in p for p in rep.problems)
    src.unlink()
    r = run_cli("run", "--pack", str(out), "--context", "128", "--max-tokens", "2", "hi")
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "m.gguf, the source file of in-place pack p, is missing" in r.stderr


def test_a_pack_moved_with_its_model_still_finds_it(tmp_path, model):
    home = tmp_path / "a"
    home.mkdir()
    src = Path(shutil.copy(model, home / "m.gguf"))
    pack(src, home / "p", progress=False, in_place=True)
    shutil.move(home, tmp_path / "b")              # the absolute path is gone, the relative one holds
    moved = tmp_path / "b" / "p"
    assert verify(moved).ok
    with mawforge.load(moved, context=128, threads=1) as m:
        assert len([ev.token for ev in m.generate("And God said", max_tokens=4, temperature=0)]) == 4


def test_shards_pack_in_place_and_read_across_files(tmp_path, model, copied):
    shards = split_gguf(model, tmp_path / "shards", max_tensors=20)
    out = tmp_path / "p"
    pack(shards[0], out, progress=False, in_place=True)
    index = read_index(out)
    assert [f.name for f in index.files] == [s.name for s in shards]
    assert len({r.file for lb in index.layers for r in lb.sources}) > 1
    a, b = ExpertStore(out, index), ExpertStore(copied, read_index(copied))
    try:
        for layer in range(len(index.layers)):
            assert _parts(a, layer, 1) == _parts(b, layer, 1)
    finally:
        a.close()
        b.close()


def test_load_of_a_gguf_packs_in_place_by_default(tmp_path, model):
    with mawforge.load(model, context=128, cache_dir=tmp_path / "cache", threads=1) as m:
        assert len([ev.token for ev in m.generate("And God said", max_tokens=3, temperature=0)]) == 3
    (made,) = (tmp_path / "cache").iterdir()
    assert read_index(made).in_place and not (made / EXPERTS).exists()
    # a layout that transcodes the experts cannot read them in place: load() copies them
    with mawforge.load(model, context=128, cache_dir=tmp_path / "c2", layout="int4pack", threads=1):
        pass
    (made,) = (tmp_path / "c2").iterdir()
    assert not read_index(made).in_place and (made / EXPERTS).exists()


def test_in_place_refuses_what_it_cannot_read_as_stored(tmp_path, model, fixtures_root):
    with pytest.raises(FormatError, match="--in-place: layer 0 .* stored transcoded .* --layout exact"):
        pack(model, tmp_path / "x", progress=False, in_place=True, layout="int4pack")
    hf = fixtures_root["qwen3_moe"]["hf"]
    with pytest.raises(FormatError, match="--in-place packs a GGUF file or shard set"):
        pack(hf, tmp_path / "y", progress=False, in_place=True)
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
    assert open_source(model).kind == "gguf"


def test_an_index_whose_reads_would_overlap_is_refused(in_place, tmp_path):
    """Each tensor's page-aligned superset is read while the others are: a template placing a
    part within a page of the previous one's end would let two reads write the same bytes."""
    bad = tmp_path / "bad"
    shutil.copytree(in_place, bad)
    d = json.loads((bad / "experts.index").read_text())
    first, second = d["layers"][0]["tensors"][:2]
    second["parts"][0]["offset"] = first["parts"][0]["offset"] + 4096 * (first["parts"][0]["nbytes"] // 4096)
    (bad / "experts.index").write_text(json.dumps(d))
    with pytest.raises(FormatError, match="a page of its own, a page past the previous one's last page"):
        read_index(bad)


def test_experts_a_whole_number_of_pages_are_read_where_they_land(tmp_path, monkeypatch):
    """Where every expert of a tensor is a whole number of pages (Qwen3's shapes), each expert's
    bytes start at the same offset in a page: where that offset keeps the part aligned as a copied
    pack's (64 bytes) the template puts the part there and the superset read lands it in place (no
    move), else the part stays on the page boundary and is moved; the bytes equal the copied pack's
    either way. This file's tensors start 32 bytes off a 64-byte line (GGUF aligns to 32): packed as
    is they are moved, packed with the rule at 32 bytes they land in place."""
    from mawforge.pack import packer
    from mawforge.synth import synth
    src = synth(tmp_path / "t.gguf", 2, vocab=2000, progress=False, report=False, hidden=256, n_head=4,
                n_head_kv=2, head_dim=64, n_expert=16, n_expert_used=4, expert_ff=256)
    pack(src, tmp_path / "cp", progress=False)
    pack(src, tmp_path / "moved", progress=False, in_place=True)
    monkeypatch.setattr(packer, "PART_ALIGN", 32)
    pack(src, tmp_path / "landed", progress=False, in_place=True)
    moved, landed = read_index(tmp_path / "moved"), read_index(tmp_path / "landed")
    assert all(t.parts[0].offset % 4096 == 0 for lb in moved.layers for t in lb.tensors)
    offs = {(lb.layer, t.name): t.parts[0].offset % 4096 for lb in landed.layers for t in lb.tensors}
    heads = {(lb.layer, t.name): {o % 4096 for o in r.offsets} for lb in landed.layers
             for t, r in zip(lb.tensors, lb.sources)}
    for key, h in heads.items():                                 # constant heads folded in, varying ones not
        assert offs[key] == (next(iter(h)) if len(h) == 1 else 0), key
    assert any(offs.values()) and not all(offs.values())
    for pk, index in ((tmp_path / "moved", moved), (tmp_path / "landed", landed)):
        for direct in (True, False):
            a = ExpertStore(pk, index, direct=direct)
            b = ExpertStore(tmp_path / "cp", read_index(tmp_path / "cp"))
            try:
                moves = [m for lb_e in ((0, 3), (1, 3)) for *_, m in a.segments(*lb_e)]
                assert not direct or (pk.name == "landed") == (moves.count(0) > 0)
                for layer in range(2):
                    for e in (0, 7, 15):
                        assert _parts(a, layer, e) == _parts(b, layer, e)
            finally:
                a.close()
                b.close()
