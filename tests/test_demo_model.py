"""The shipped demo model (mawforge/demo/): small llama.cpp-made GGUF files of a trained
Qwen3-MoE whose vocabulary llama.cpp and `tokenizers` split alike, top-1 agreement with
llama.cpp, a transparent expert cache, a route trace that replays under the Belady bound,
the trainer's model equal to transformers' Qwen3MoeForCausalLM, and routing profiles for synth."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from tokenizers import Tokenizer

from mawforge.demo import DEMO_DIR, ROUTING_PROFILE, demo_gguf
from mawforge.engine.generate import generate
from mawforge.commands.run import make_recorder
from mawforge.engine.runtime import Runtime, RuntimeOptions
from mawforge.engine.sampling import SamplingParams
from mawforge.errors import FormatError
from mawforge.fixtures.llama_ref import llama_logits, llama_tokenize_many
from mawforge.synth.routing import routing_stats
from mawforge.synth.routing_profile import load_profile, measure
from mawforge.synth import synth
from mawforge.pack.manifest import read_index
from mawforge.trace.oracle import access_sequence, uniform_sizes
from mawforge.trace.record import load_trace
from mawforge.trace.replay import live_check, replay

# KJV (public domain) and prose written for this test, which the model never saw.
TEXT = (
    "The LORD is my shepherd; I shall not want. He maketh me to lie down in green pastures: he leadeth me "
    "beside the still waters. He restoreth my soul: he leadeth me in the paths of righteousness for his "
    "name's sake.\nTo every thing there is a season, and a time to every purpose under the heaven: a time "
    "to be born, and a time to die; a time to plant, and a time to pluck up that which is planted.\n"
    "In the beginning was the Word, and the Word was with God, and the Word was God.\n\n"
    "A dictionary maps keys to values. The keys must be hashable, and the method get() returns a default "
    "when a key is missing. To loop over the items of a dictionary, use the items() method:\n\n"
    "   for key, value in table.items():\n       print(key, value)\n\n"
    "The with statement makes sure that a file is closed when the block ends, even if an exception is "
    "raised inside it. A generator function returns an iterator; each yield hands one value to the caller."
)
TOKENIZER_SAMPLES = (
    TEXT, "  leading spaces,\ttabs\n\n\nand   runs   of   spaces  ", "Numbers 12345 and 3.14159, x**2 == 0x1F?",
    "Unicode: naïve café — “quoted” ünïcödé 日本語 😀", "def f(a, b=None):\n    return {'k': [a, b]}\n",
    "<|im_start|>user\nWhat does Genesis 1:3 say?<|im_end|>\n<|im_start|>assistant\n", "it's they're we'll I'D",
)
CHAT = "<|im_start|>user\nWhat does Genesis 1:3 say?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def demo_packs(tmp_path_factory) -> dict:
    from mawforge.pack.packer import pack
    root = tmp_path_factory.mktemp("demo")
    for ftype in ("Q8_0", "Q4_K_M"):
        pack(demo_gguf(ftype), root / ftype, progress=False)
    return {f: root / f for f in ("Q8_0", "Q4_K_M")}


def _runtime(pack, recorder=None, **kw) -> Runtime:
    opts = {"context": 512, "prefill_chunk": 64} | ({} if "expert_cache_gib" in kw else {"expert_cache_percent": 50})
    return Runtime(pack, RuntimeOptions(**(opts | kw)), recorder=recorder)


def test_shipped_files_are_small_qwen3moe_quantized_by_llama_cpp():
    for ftype, file_type in (("Q8_0", 7), ("Q4_K_M", 15)):
        path = demo_gguf(ftype)
        assert path.stat().st_size <= 25 * 2**20
        r = GGUFReader(path)
        kv = lambda key: r.fields[key].contents()  # noqa: E731
        assert kv("general.architecture") == "qwen3moe" and kv("general.file_type") == file_type
        assert kv("qwen3moe.expert_count") >= 16 and kv("qwen3moe.expert_used_count") >= 2
        assert kv("qwen3moe.embedding_length") % 256 == 0
        assert (kv("tokenizer.ggml.model"), kv("tokenizer.ggml.pre")) == ("gpt2", "qwen2")
        assert "<|im_start|>" in kv("tokenizer.chat_template")
    types = {t.name: t.tensor_type.name for t in GGUFReader(demo_gguf("Q4_K_M")).tensors}
    assert types["output.weight"] == "Q6_K" and types["blk.0.ffn_gate_exps.weight"] == "Q4_K"


def test_tokenizer_ids_agree_between_tokenizers_llama_cpp_and_the_runtime(demo_packs):
    hf = Tokenizer.from_file(str(DEMO_DIR / "tokenizer.json"))
    want = [hf.encode(t).ids for t in TOKENIZER_SAMPLES]
    assert llama_tokenize_many(demo_gguf("Q4_K_M"), list(TOKENIZER_SAMPLES)) == want
    rt = _runtime(demo_packs["Q4_K_M"])
    try:
        assert [rt.tokenizer.encode(t) for t in TOKENIZER_SAMPLES] == want
        assert rt.tokenizer.decode(want[0]) == TEXT
    finally:
        rt.close()


@pytest.mark.parametrize("ftype", ["Q8_0", "Q4_K_M"])
def test_teacher_forced_top1_agreement_with_llama_cpp(demo_packs, ftype):
    """A trained model has clear top-1 margins, unlike the random fixtures (96-99% there)."""
    tokens = Tokenizer.from_file(str(DEMO_DIR / "tokenizer.json")).encode(TEXT).ids
    ref = llama_logits(demo_gguf(ftype), tokens, n_ctx=512)
    rt = _runtime(demo_packs[ftype])
    try:
        got = rt.forward(tokens, all_logits=True).numpy()
    finally:
        rt.close()
    agree = (got.argmax(-1) == ref.argmax(-1)).mean()
    print(f"demo {ftype}: top-1 agreement with llama.cpp {agree:.4f} over {len(tokens)} positions")
    assert len(tokens) >= 200 and agree >= 0.99


def _greedy(pack, n=32, recorder=None, **kw):
    rt = _runtime(pack, recorder=recorder, **kw)
    try:
        evs = list(generate(rt, rt.tokenizer.encode(CHAT), SamplingParams(max_tokens=n, ignore_eos=True)))
        return [e.token for e in evs], "".join(e.text for e in evs), rt
    finally:
        rt.close()


def test_cache_is_transparent_across_budgets_and_policies(demo_packs):
    pack = demo_packs["Q4_K_M"]
    want, text, _ = _greedy(pack, expert_cache_percent=100)
    assert sum(ch.isalpha() or ch.isspace() for ch in text) >= 0.7 * len(text) > 0   # words, not byte soup
    minimum = max(-(-lb.block_nbytes // 4096) * 4096 for lb in read_index(pack).layers) * 2
    for policy in ("lru", "s3fifo"):
        for kw in (dict(expert_cache_gib=minimum / 2**30), dict(expert_cache_percent=25),
                   dict(expert_cache_percent=50)):
            assert _greedy(pack, policy=policy, **kw)[0] == want, (policy, kw)


def test_route_trace_replays_live_counts_under_the_belady_bound(demo_packs, tmp_path):
    pack, path = demo_packs["Q8_0"], tmp_path / "trace.npz"   # Q8_0: equal block sizes, Belady is a bound
    recorder = make_recorder(argparse.Namespace(trace_out=str(path), pack=pack))
    _, _, rt = _greedy(pack, n=48, recorder=recorder, expert_cache_percent=25, policy="lru")
    recorder.set_live(rt.plan.E, "lru", rt.prefetch_spec, rt.cache.core.stats())   # default: auto prefetch
    recorder.save(path)
    trace = load_trace(path)
    assert live_check(trace)["match"]
    assert uniform_sizes(access_sequence(trace))
    rows = replay(trace, ["25%", "50%", "75%"], ["lru", "lfu", "fifo", "random", "s3fifo", "belady"], seeds=[0, 1])
    for budget in ("25%", "50%", "75%"):
        at = [r for r in rows if r["budget"] == budget and r["status"] == "ok"]
        best = next(r["hits"] for r in at if r["policy"] == "belady")
        assert len(at) == 7 and all(best >= r["hits"] for r in at)


def test_trainer_model_is_transformers_qwen3_moe(tmp_path):
    """scripts/demo_moe.py trains the model transformers computes, under its checkpoint names."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from demo_moe import DemoConfig, DemoMoe
    torch.manual_seed(0)
    cfg = DemoConfig(vocab_size=512, num_hidden_layers=2, num_experts=8)
    model = DemoMoe(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))       # norms away from 1, routing decisive
    (tmp_path / "config.json").write_text(json.dumps(cfg.hf_config(0, 1, 0)))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "model.safetensors"),
              metadata={"format": "pt"})
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    ids = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids)[0], hf(ids).logits, rtol=0, atol=1e-4)


def test_routing_profile_is_valid_and_synth_follows_it(tmp_path):
    prof = load_profile(ROUTING_PROFILE)
    assert prof.n_experts >= 16 and len(prof.layers) >= 2
    dims = dict(hidden=256, n_head=4, n_head_kv=2, head_dim=64, n_expert=prof.n_experts,
                n_expert_used=prof.top_k, expert_ff=256)
    n = len(prof.layers)
    got = {}
    for name, kw in (("plain", {}), ("profile", {"routing_profile": prof})):
        path = synth(tmp_path / f"{name}.gguf", n, vocab=2000, progress=False, report_tokens=128, **dims, **kw)
        got[name] = json.loads(Path(str(path) + ".routing.json").read_text())
    want_h = np.array([la.entropy for la in prof.layers])
    want_o = np.array([la.overlap for la in prof.layers])
    err = {k: (np.abs(np.array([x["entropy"] for x in v["layers"]]) - want_h).mean(),
               np.abs(np.array([x["overlap"] for x in v["layers"]]) - want_o).mean()) for k, v in got.items()}
    print(f"|entropy error|, |overlap error| per layer, mean: {err}")
    assert err["profile"][0] < err["plain"][0] and err["profile"][1] < err["plain"][1]


def test_routing_profiles_measure_and_reject_bad_files(tmp_path):
    seq = np.array([[[0, 1]], [[0, 2]], [[3, 1]], [[0, 1]]])          # [T=4, L=1, K=2]
    prof = measure([seq], n_experts=4)
    stats = routing_stats(seq, 4)["layers"][0]
    assert prof.layers[0].overlap == pytest.approx(stats["overlap"])
    assert prof.layers[0].entropy == pytest.approx(stats["entropy"])
    assert sum(prof.layers[0].inclusion) == pytest.approx(2)
    assert prof.inclusion_for(0, 1, 4, 2) == pytest.approx(prof.layers[0].inclusion)
    assert prof.inclusion_for(0, 1, 8, 4).sum() == pytest.approx(4) and prof.inclusion_for(0, 1, 8, 4).max() <= 1
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(prof.to_json() | {"top_k": 3}))
    with pytest.raises(FormatError, match="do not fit"):
        load_profile(bad)
    bad.write_text("{")
    with pytest.raises(FormatError, match="cannot read"):
        load_profile(bad)
    with pytest.raises(FormatError, match="drop --skew"):
        synth(tmp_path / "x.gguf", 1, vocab=2000, skew=1.0, routing_profile=prof, progress=False)


def test_synth_cli_takes_a_routing_profile(tmp_path, monkeypatch):
    import mawforge.synth as mod
    parser = argparse.ArgumentParser()
    mod.add_arguments(parser)
    args = parser.parse_args(["-o", str(tmp_path / "c.gguf"), "--layers", "2", "--vocab", "1024",
                              "--routing-profile", str(ROUTING_PROFILE)])
    prof = load_profile(ROUTING_PROFILE)
    tiny = dict(hidden=256, n_head=4, n_head_kv=2, head_dim=64, n_expert=prof.n_experts,
                n_expert_used=prof.top_k, expert_ff=256)
    monkeypatch.setattr(mod, "synth", lambda *a, **kw: synth(*a, **kw, **tiny, progress=False))
    assert mod.main(args) == 0
    report = json.loads((tmp_path / "c.gguf.routing.json").read_text())
    assert report["synth"]["profile"]["n_experts"] == prof.n_experts
    assert GGUFReader(tmp_path / "c.gguf").fields["mawforge.synth.routing_profile"].contents() == prof.source
