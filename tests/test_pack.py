"""Split packs: block bytes against the source, HF vs GGUF, verify, determinism, atomicity, errors."""
from __future__ import annotations

import os
import shutil
import struct
import subprocess

import numpy as np
import pytest
import torch

from helpers import ARCHS, GGUF_FTYPES, pack_expert, run_cli, source_expert_f32
from mawforge.errors import FormatError, MawError, PackExists
from mawforge.codecs import quants
from mawforge.formats.source import open_source
from mawforge.pack import packer
from mawforge.pack.manifest import EXPERTS, read_index, read_manifest
from mawforge.pack.verify import verify


def _src_path(fixtures_root, arch, source):
    fx = fixtures_root[arch]
    return fx[source] if source in ("hf", "hf_fused") else fx["gguf"][source]


def _bf16_bound(ref: np.ndarray, group: int = 32) -> np.ndarray:
    """int4_g32 keeps scale and zero in bf16: per weight |error| <= 2^-8 * (15*|scale| + |zero|),
    bounded here by 2^-7 times the largest magnitude in the weight's group of 32."""
    g = np.abs(ref).reshape(ref.shape[0], -1, group).max(-1, keepdims=True)
    return np.broadcast_to(g * 2.0**-7 + 1e-7, ref.reshape(ref.shape[0], -1, group).shape).reshape(ref.shape)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("source,layout", [(s, "exact") for s in ("hf", "hf_fused") + GGUF_FTYPES]
                         + [("Q8_0", "int4pack"), ("Q4_K_M", "int4pack")])
def test_every_block_equals_its_source(fixtures_root, packs, arch, source, layout):
    """exact packs hold the source bytes; int4pack packs are within the bf16 rounding bound."""
    pack = packs[(arch, source, layout)]
    src = open_source(_src_path(fixtures_root, arch, source))
    index = read_index(pack)
    for layer in range(src.config.n_layers):
        for e in range(src.config.n_experts):
            got = pack_expert(pack, index, layer, e)
            for kind in src.expert_kinds(layer):
                ref = source_expert_f32(src, layer, kind, e)
                w = got[kind]
                deq = quants.dequantize(w).numpy()
                if w.codec in packer.BYTE_EXACT:
                    path, off, n = src.experts[(layer, kind)].pieces[e]
                    with open(path, "rb") as f:
                        f.seek(off)
                        raw = f.read(n)
                    stored = b"".join(t.numpy().tobytes() for t in w.parts.values())
                    assert stored == raw, f"layer {layer} expert {e} {kind}: bytes differ"
                    np.testing.assert_array_equal(deq, ref)
                else:
                    assert np.all(np.abs(deq - ref) <= _bf16_bound(ref)), f"{w.codec} beyond bf16 rounding"


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_and_gguf_packs_hold_the_same_experts(packs, arch):
    a, b, c = (packs[(arch, s)] for s in ("hf", "hf_fused", "F32"))
    ia, ib, ic = read_index(a), read_index(b), read_index(c)
    cfg = read_manifest(a).config
    for layer in range(cfg.n_layers):
        for e in range(cfg.n_experts):
            ea, eb, ec = (pack_expert(p, i, layer, e) for p, i in ((a, ia), (b, ib), (c, ic)))
            for kind in ("gate", "up", "down"):
                ref = quants.dequantize(ea[kind])
                torch.testing.assert_close(quants.dequantize(ec[kind]), ref, rtol=0, atol=0)
            gu = quants.dequantize(eb["gate_up"])
            torch.testing.assert_close(gu, torch.cat([quants.dequantize(ea["gate"]), quants.dequantize(ea["up"])]),
                                       rtol=0, atol=0)


def test_blocks_are_aligned_and_index_is_complete(packs):
    pack = packs[("qwen3_moe", "Q4_K_M")]
    man, index = read_manifest(pack), read_index(pack)
    assert man.alignment == 65536 and index.alignment == 65536
    sizes = set()
    for lb in index.layers:
        assert len(lb.offsets) == man.config.n_experts
        for off, d in zip(lb.offsets, lb.digests):
            assert off % 65536 == 0 and len(d) == 32
        sizes.add(lb.block_nbytes)
    assert len(sizes) > 1, "the Q4_K_M mix has different block sizes by layer"
    assert os.path.getsize(pack / EXPERTS) >= index.layers[-1].offsets[-1] + index.layers[-1].block_nbytes


def test_flipped_byte_is_named_by_verify(packs, tmp_path):
    pack = tmp_path / "p"
    shutil.copytree(packs[("olmoe", "Q8_0")], pack)
    index = read_index(pack)
    off, n, _ = index.block(1, 5)
    with open(pack / EXPERTS, "r+b") as f:
        f.seek(off + n // 2)
        b = f.read(1)
        f.seek(off + n // 2)
        f.write(bytes([b[0] ^ 0x40]))
    rep = verify(pack)
    assert not rep.ok and rep.damaged_blocks == [(1, 5)]
    r = run_cli("verify", str(pack))
    assert r.returncode == 3
    assert "layer 1 expert 5" in r.stdout and "Traceback" not in r.stderr


def test_verify_accepts_intact_pack(packs):
    rep = verify(packs[("mixtral", "Q4_K_M")])
    assert rep.ok and rep.blocks_checked == 3 * 8 and rep.common_checked > 0


def test_packing_is_deterministic(fixtures_root, tmp_path):
    src = fixtures_root["qwen2_moe"]["gguf"]["Q4_K_M"]
    m1 = packer.pack(src, tmp_path / "a", progress=False)
    m2 = packer.pack(src, tmp_path / "b", progress=False)
    assert m1.pack_digest == m2.pack_digest
    assert (tmp_path / "a" / EXPERTS).read_bytes() == (tmp_path / "b" / EXPERTS).read_bytes()
    assert m1.source["digest"] == m2.source["digest"]


def test_refuses_to_overwrite_without_force(fixtures_root, tmp_path):
    src = fixtures_root["qwen3_moe"]["gguf"]["Q8_0"]
    out = tmp_path / "p"
    packer.pack(src, out, progress=False)
    with pytest.raises(PackExists):
        packer.pack(src, out, progress=False)
    r = run_cli("pack", str(src), "-o", str(out))
    assert r.returncode == 2 and "--force" in r.stderr and "Traceback" not in r.stderr
    packer.pack(src, out, progress=False, force=True)
    assert read_manifest(out).config.arch == "qwen3moe"


@pytest.mark.parametrize("layout", ["exact", "int4pack"])
def test_failure_mid_pack_leaves_nothing(fixtures_root, tmp_path, monkeypatch, layout):
    src = fixtures_root["qwen3_moe"]["gguf"]["Q4_K_M"]
    calls = {"n": 0}
    real = packer._Progress.update

    def boom(self, n):
        calls["n"] += 1
        if calls["n"] > 5:
            raise KeyboardInterrupt
        return real(self, n)

    monkeypatch.setattr(packer._Progress, "update", boom)
    with pytest.raises(KeyboardInterrupt):
        packer.pack(src, tmp_path / "p", layout=layout, progress=False)
    assert calls["n"] > 5
    assert list(tmp_path.iterdir()) == []


def _truncated(path, tmp_path, keep):
    out = tmp_path / ("trunc" + path.suffix)
    out.write_bytes(path.read_bytes()[:keep])
    return out


@pytest.mark.parametrize("case", ["missing", "garbage", "truncated-header", "truncated-data",
                                  "bad-safetensors", "truncated-safetensors"])
def test_bad_inputs_give_one_line_errors(fixtures_root, tmp_path, case):
    gguf = fixtures_root["qwen3_moe"]["gguf"]["Q8_0"]
    if case == "missing":
        src = tmp_path / "nope.gguf"
    elif case == "garbage":
        src = tmp_path / "g.gguf"
        src.write_bytes(os.urandom(4096))
    elif case == "truncated-header":
        src = _truncated(gguf, tmp_path, 200)
    elif case == "truncated-data":
        src = _truncated(gguf, tmp_path, os.path.getsize(gguf) - 1000)
    else:
        src = tmp_path / "hf"
        shutil.copytree(fixtures_root["qwen3_moe"]["hf"], src)
        st = src / "model.safetensors"
        data = st.read_bytes()
        st.write_bytes(struct.pack("<Q", 10**9) + data[8:] if case == "bad-safetensors" else data[: len(data) // 2])
    with pytest.raises(FormatError):
        packer.pack(src, tmp_path / "out", progress=False)
    r = run_cli("pack", str(src), "-o", str(tmp_path / "out"))
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "error:" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_unsupported_architecture_is_named(fixtures_root, tmp_path):
    src = tmp_path / "hf"
    shutil.copytree(fixtures_root["qwen3_moe"]["hf"], src)
    cfg = (src / "config.json").read_text().replace('"qwen3_moe"', '"gpt_neox"')
    (src / "config.json").write_text(cfg)
    r = run_cli("pack", str(src), "-o", str(tmp_path / "out"))
    assert r.returncode == 2 and "gpt_neox" in r.stderr and "qwen3_moe" in r.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_full_disk_is_a_clean_error(fixtures_root, tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], check=True)
    try:
        with pytest.raises(MawError, match="disk full"):
            packer.pack(fixtures_root["qwen3_moe"]["gguf"]["F32"], mnt / "p", progress=False)
        assert list(mnt.iterdir()) == []
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_inspect_table_and_json(packs, fixtures_root):
    import json
    r = run_cli("inspect", str(packs[("qwen2_moe", "Q4_K_M")]), "--json")
    d = json.loads(r.stdout)
    assert d["architecture"] == "qwen2moe" and d["experts"] == 8 and d["top_k"] == 2
    assert d["expert_bytes"] > 0 and len(d["block_bytes_by_layer"]) == 3
    assert any(k.startswith("Q6_K") for k in d["quant_types"])
    r = run_cli("inspect", str(fixtures_root["mixtral"]["gguf"]["Q8_0"]))
    assert r.returncode == 0 and "mixtral" in r.stdout and "routed expert bytes" in r.stdout
