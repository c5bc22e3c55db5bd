"""Each layer's weights are bound once when the runtime opens: a tensor the architecture reads
that the pack lacks (or holds with the wrong rank) is refused there, naming it, not mid-decode."""
from __future__ import annotations

import pytest

from mawforge.engine.runtime import Runtime, RuntimeOptions
from mawforge.errors import FormatError
from mawforge.formats import required
from mawforge.fuzz import gguf_codec as gc
from mawforge.pack.packer import pack


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    from mawforge.synth import synth
    out = tmp_path_factory.mktemp("bind") / "tiny.gguf"
    return synth(out, 2, vocab=1024, hidden=256, n_head=4, n_head_kv=2, head_dim=64, n_expert=8,
                 n_expert_used=2, expert_ff=256, dense_ff=512, report=False, progress=False)


def _pack_without(tiny_gguf, tmp_path, monkeypatch, name: str, edit=None):
    """A pack of the tiny model without `name` (or with `edit` applied to it), packed as a packer
    that did not check required tensors would have packed it."""
    m = gc.parse(tiny_gguf.read_bytes())
    t = next(t for t in m.tensors if t.name == name)
    if edit is None:
        m.tensors.remove(t)
    else:
        edit(t)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(gc.dump(m))
    with monkeypatch.context() as mp:
        mp.setattr(required, "check_required", lambda cfg, common: None)
        pack(bad, tmp_path / "pack", progress=False)
    return tmp_path / "pack"


@pytest.mark.parametrize("name", ["blk.1.attn_q_norm.weight", "blk.0.attn_k.weight", "blk.1.ffn_gate_inp.weight"])
def test_a_missing_tensor_fails_when_the_runtime_opens(tiny_gguf, tmp_path, monkeypatch, name):
    p = _pack_without(tiny_gguf, tmp_path, monkeypatch, name)
    with pytest.raises(FormatError, match=name.replace(".", r"\.")):
        Runtime(p, RuntimeOptions(context=64))


def test_a_mis_ranked_tensor_fails_when_the_runtime_opens(tiny_gguf, tmp_path, monkeypatch):
    name = "blk.0.attn_output.weight"
    p = _pack_without(tiny_gguf, tmp_path, monkeypatch, name, edit=lambda t: setattr(t, "ne", [t.ne[0] * t.ne[1]]))
    with pytest.raises(FormatError, match=name.replace(".", r"\.") + ".*2-D"):
        Runtime(p, RuntimeOptions(context=64))


def test_a_complete_pack_binds_every_layer(tiny_gguf, tmp_path):
    pack(tiny_gguf, tmp_path / "pack", progress=False)
    rt = Runtime(tmp_path / "pack", RuntimeOptions(context=64))
    assert len(rt.model.layers) == 2 and "attn_q_norm.weight" in rt.model.layers[1]
    assert rt.model.layers[0]["attn_q.weight"] is rt.weights.packed("blk.0.attn_q.weight")
