"""Damaged and hostile inputs: every reader refuses them with one FormatError line, `pack`
refuses a source missing a tensor its architecture needs, `verify` checks every declared
range against the file before reading (in bounded chunks) and recomputes the manifest's,
the index's and the templates' digests, and the CLI prints one line, never a traceback."""
from __future__ import annotations

import json
import os
import shutil
import struct

import pytest
from gguf import GGUFValueType as VT

from helpers import run_cli
from mawforge.errors import FormatError
from mawforge.formats.source import open_source
from mawforge.fuzz import gguf_codec as gc
from mawforge.pack import verify as verify_mod
from mawforge.pack.manifest import (INDEX, MANIFEST, compute_pack_digest, read_index, read_manifest)
from mawforge.pack.packer import pack
from mawforge.pack.verify import verify


@pytest.fixture(scope="module")
def synth_gguf(tmp_path_factory):
    """A tiny qwen3moe GGUF in llama.cpp's Q4_K_M mix (no transformers needed)."""
    from mawforge.synth import synth
    out = tmp_path_factory.mktemp("harden") / "tiny.gguf"
    return synth(out, 2, vocab=1024, hidden=256, n_head=4, n_head_kv=2, head_dim=64, n_expert=8,
                 n_expert_used=2, expert_ff=256, dense_ff=512, report=False, progress=False)


@pytest.fixture(scope="module")
def good_pack(synth_gguf, tmp_path_factory):
    out = tmp_path_factory.mktemp("harden_pack") / "pack"
    pack(synth_gguf, out, progress=False)
    return out


def _gguf(seed, tmp_path, edit):
    m = gc.parse(seed.read_bytes())
    counts = edit(m) or {}
    out = tmp_path / "bad.gguf"
    out.write_bytes(gc.dump(m, **counts))
    return out


def _set(key, vt, v):
    def edit(m):
        kv = m.key(key)
        kv[1], kv[2] = int(vt), v
    return edit


def _tensor(name, **kw):
    def edit(m):
        t = next(t for t in m.tensors if t.name == name)
        for k, v in kw.items():
            setattr(t, k, v(t) if callable(v) else v)
    return edit


def _drop(name):
    return lambda m: m.tensors.remove(next(t for t in m.tensors if t.name == name))


GGUF_CASES = {
    "string count": (_set("qwen3moe.expert_count", VT.STRING, "eight"), "qwen3moe.expert_count"),
    "NaN epsilon": (_set("qwen3moe.attention.layer_norm_rms_epsilon", VT.FLOAT32, float("nan")), "nan"),
    "inf rope base": (_set("qwen3moe.rope.freq_base", VT.FLOAT64, float("inf")), "inf"),
    "array count": (_set("qwen3moe.block_count", VT.ARRAY, (VT.UINT32, [2, 2])), "layer count"),
    "empty array": (_set("qwen3moe.embedding_length", VT.ARRAY, (VT.UINT32, [])), "embedding_length"),
    "nested arrays": (_set("general.name", VT.ARRAY, (VT.ARRAY, [(VT.ARRAY, [(VT.UINT8, [1])])])), "nested"),
    "huge layer count": (_set("qwen3moe.block_count", VT.UINT64, 2**40), "layer count"),
    "zero dim expert": (_tensor("blk.0.ffn_gate_exps.weight", ne=lambda t: [t.ne[0], t.ne[1], 0]), "dims"),
    "1-D expert": (_tensor("blk.0.ffn_up_exps.weight", ne=lambda t: [t.ne[0]]), "not 3-D"),
    "overlap": (lambda m: setattr(m.tensors[3], "offset", m.tensors[2].offset), "overlap"),
    "misaligned": (_tensor("output_norm.weight", offset=lambda t: t.offset + 4), "aligned"),
    "no router": (_drop("blk.1.ffn_gate_inp.weight"), "blk.1.ffn_gate_inp.weight"),
    "no attn norm": (_drop("blk.0.attn_norm.weight"), "blk.0.attn_norm.weight"),
    "no k proj": (_drop("blk.1.attn_k.weight"), "blk.1.attn_k.weight"),
    "1-D projection": (_tensor("blk.0.attn_output.weight", ne=lambda t: [t.ne[0]]), "2-D"),
    "count lies": (lambda m: {"n_tensors": 2**40}, "malformed GGUF"),
}


@pytest.mark.parametrize("case", GGUF_CASES)
def test_damaged_gguf_is_one_format_error(synth_gguf, tmp_path, case):
    edit, needle = GGUF_CASES[case]
    bad = _gguf(synth_gguf, tmp_path, edit)
    with pytest.raises(FormatError) as e:
        pack(bad, tmp_path / "out", progress=False)
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()


# ---- safetensors, config.json, index.json --------------------------------------------------

def _hf_copy(fixtures_root, tmp_path):
    d = tmp_path / "hf"
    shutil.copytree(fixtures_root["qwen3_moe"]["hf"], d)
    return d


def _header_edit(d, fn):
    f = d / "model.safetensors"
    b = f.read_bytes()
    n = struct.unpack("<Q", b[:8])[0]
    head = json.loads(b[8:8 + n])
    fn(head)
    raw = json.dumps(head).encode()
    f.write_bytes(struct.pack("<Q", len(raw)) + raw + b[8 + n:])


def _entry(pattern, **kw):
    def fn(head):
        name = next(k for k in sorted(head) if pattern in k)
        for k, v in kw.items():
            head[name][k] = v(head[name]) if callable(v) else v
    return fn


def _other_offsets(head):
    names = sorted(k for k in head if k != "__metadata__")
    a, b = head[names[0]]["data_offsets"], head[names[1]]["data_offsets"]
    head[names[1]]["data_offsets"] = [a[0], a[0] + b[1] - b[0]]


HF_CASES = {
    "scalar expert": (lambda d: _header_edit(d, _entry("experts.0.up_proj", shape=[])), "shape"),
    "list dtype": (lambda d: _header_edit(d, _entry("q_proj", dtype=["F32"])), "dtype"),
    "string offsets": (lambda d: _header_edit(d, _entry("q_proj", data_offsets=lambda e: [str(e["data_offsets"][0]),
                                                                                          e["data_offsets"][1]])),
                       "data_offsets"),
    "fractional offsets": (lambda d: _header_edit(d, _entry("q_proj", data_offsets=lambda e: [
        e["data_offsets"][0] + 0.5, e["data_offsets"][1] + 0.5])), "data_offsets"),
    "negative offsets": (lambda d: _header_edit(d, _entry("q_proj", data_offsets=lambda e: [
        -64, e["data_offsets"][1] - e["data_offsets"][0] - 64])), "data_offsets"),
    "overlapping": (lambda d: _header_edit(d, _other_offsets), "overlap"),
    "size vs shape": (lambda d: _header_edit(d, _entry("q_proj", shape=lambda e: [e["shape"][0] * 2, e["shape"][1]])),
                      "bytes for"),
    "no router": (lambda d: _header_edit(d, lambda h: h.pop("model.layers.1.mlp.gate.weight")),
                  "blk.1.ffn_gate_inp.weight"),
    "config a list": (lambda d: (d / "config.json").write_text("[1, 2]"), "JSON object"),
    "config bad type": (lambda d: (d / "config.json").write_text(json.dumps(
        {**json.loads((d / "config.json").read_text()), "num_experts": "eight"})), "num_experts"),
    "config nested": (lambda d: (d / "config.json").write_text('{"a": ' + "[" * 5000 + "]" * 5000 + "}"), "nested"),
    "config not utf-8": (lambda d: (d / "config.json").write_bytes(b'{"model_type": "\xff"}'), "UTF-8"),
    "index escapes": (lambda d: (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "../x/model.safetensors"}})), "outside the model directory"),
    "index map a list": (lambda d: (d / "model.safetensors.index.json").write_text('{"weight_map": [1]}'),
                         "weight_map"),
    "shard is a directory": (lambda d: ((d / "model.safetensors").unlink(), (d / "model.safetensors").mkdir()),
                             "not a file"),
}


@pytest.mark.parametrize("case", HF_CASES)
def test_damaged_hf_directory_is_one_format_error(fixtures_root, tmp_path, case):
    edit, needle = HF_CASES[case]
    d = _hf_copy(fixtures_root, tmp_path)
    edit(d)
    with pytest.raises(FormatError) as e:
        open_source(d)
    assert needle in str(e.value) and "\n" not in str(e.value)


# ---- the pack's JSON and bytes -------------------------------------------------------------

def _copy_pack(good_pack, tmp_path):
    p = tmp_path / "pack"
    shutil.copytree(good_pack, p)
    return p


def _edit_json(path, fn):
    d = json.loads(path.read_text())
    fn(d)
    path.write_text(json.dumps(d))


@pytest.mark.parametrize("file,edit,needle", [
    (MANIFEST, lambda d: d.update(alignment="65536"), "alignment"),
    (MANIFEST, lambda d: d["config"].update(hidden="256"), "hidden"),
    (MANIFEST, lambda d: d["common"][0]["parts"][0].update(nbytes=-1), "nbytes"),
    (MANIFEST, lambda d: d.update(common_digests=[1]), "common_digests"),
    (MANIFEST, lambda d: d["tokenizer"].update(files=["../../etc/passwd"]), "tokenizer file"),
    (INDEX, lambda d: d["layers"][0]["blocks"][0].__setitem__(0, 2**63), "offset"),
    (INDEX, lambda d: d["layers"][1].update(block_nbytes="big"), "block_nbytes"),
    (INDEX, lambda d: d["layers"][0]["tensors"][0]["parts"][0].update(offset=2**30), "past the block"),
    (INDEX, lambda d: d.update(layers={"0": 1}), "layers"),
])
def test_pack_json_of_the_wrong_shape_is_one_format_error(good_pack, tmp_path, file, edit, needle):
    p = _copy_pack(good_pack, tmp_path)
    _edit_json(p / file, edit)
    for read in (read_manifest if file == MANIFEST else read_index, verify):
        with pytest.raises(FormatError) as e:
            read(p)
        assert needle in str(e.value) and "\n" not in str(e.value)


def test_verify_never_reads_more_than_its_chunk_of_a_lying_index(good_pack, tmp_path, monkeypatch):
    p = _copy_pack(good_pack, tmp_path)
    _edit_json(p / INDEX, lambda d: d["layers"][1].update(block_nbytes=2**40))
    sizes = []
    real = os.pread
    monkeypatch.setattr(verify_mod.os, "pread", lambda fd, n, off: sizes.append(n) or real(fd, n, off))
    rep = verify(p)
    assert not rep.ok and (1, 0) in rep.damaged_blocks
    assert sizes and max(sizes) <= verify_mod.CHUNK


@pytest.mark.parametrize("what,edit,needle", [
    ("manifest value", lambda p: _edit_json(p / MANIFEST, lambda d: d.update(layout="int4pack")), "manifest_digest"),
    ("manifest source", lambda p: _edit_json(p / MANIFEST, lambda d: d["source"].update(path="/elsewhere")),
     "manifest_digest"),
    ("index template", lambda p: _edit_json(p / INDEX, lambda d: d["layers"][0]["tensors"][0]["parts"][0].update(
        offset=d["layers"][0]["tensors"][0]["parts"][0]["offset"] + 64)), "template"),
    ("tokenizer file", lambda p: (p / "tokenizer.gguf.json").write_text("{}"), "tokenizer"),
    ("common.bin a directory", lambda p: ((p / "common.bin").unlink(), (p / "common.bin").mkdir()), "common.bin"),
    ("experts.pack short", lambda p: os.truncate(p / "experts.pack", 100), "experts.pack has 100 bytes"),
])
def test_verify_names_every_edit(good_pack, tmp_path, what, edit, needle):
    p = _copy_pack(good_pack, tmp_path)
    edit(p)
    rep = verify(p)
    assert not rep.ok and needle in "\n".join(rep.lines())


def test_an_edited_manifest_is_refused_before_plan_or_run_use_it(good_pack, tmp_path):
    p = _copy_pack(good_pack, tmp_path)
    _edit_json(p / MANIFEST, lambda d: d["config"]["extra"].update(kv_layers="garbage"))
    with pytest.raises(FormatError, match="edited after packing"):
        read_manifest(p)
    r = run_cli("plan", "--pack", str(p), "--memory-budget-gib", "2")
    assert r.returncode == 2 and "edited after packing" in r.stderr and "Traceback" not in r.stderr


def test_format_1_packs_are_still_read_and_verified(good_pack, tmp_path):
    """A pack written before format 2 (no template, index or manifest digests) reads and
    verifies, with a note saying what could not be checked."""
    p = _copy_pack(good_pack, tmp_path)
    man, index = read_manifest(p), read_index(p)

    def index_v1(d):
        d["format_version"] = 1
        for lb in d["layers"]:
            lb.pop("tensors_digest")

    def manifest_v1(d):
        d["format_version"] = 1
        for k in ("index_digest", "manifest_digest"):
            d.pop(k)
        d["tokenizer"].pop("digests")
        d["pack_digest"] = compute_pack_digest(d["config"], man.common, man.common_digests, index, version=1)

    _edit_json(p / INDEX, index_v1)
    _edit_json(p / MANIFEST, manifest_v1)
    rep = verify(p)
    assert rep.ok and rep.blocks_checked == 16 and any("format 1" in n for n in rep.notes)


# ---- the command line ----------------------------------------------------------------------

def test_user_mistakes_on_the_command_line_are_one_line(synth_gguf, good_pack, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    nonpack = tmp_path / "stuff"
    nonpack.mkdir()
    (nonpack / "keep.txt").write_text("mine")
    # (verify of a GGUF checks its files since shards: tests/test_shards.py; a plain file is still a mistake)
    cases = [("verify", str(afile)), ("pack", str(synth_gguf), "-o", str(afile / "x.pack")),
             ("pack", str(synth_gguf), "-o", str(afile), "--force"), ("inspect", str(afile)),
             ("verify", str(tmp_path / "missing")), ("pack", str(good_pack), "-o", str(tmp_path / "y")),
             ("pack", str(synth_gguf), "-o", str(nonpack), "--force"), ("inspect", str(good_pack / MANIFEST))]
    for args in cases:
        r = run_cli(*args)
        assert r.returncode == 2, (args, r.stderr)
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, (args, r.stderr)
    assert (nonpack / "keep.txt").read_text() == "mine"     # --force never replaces a non-pack
