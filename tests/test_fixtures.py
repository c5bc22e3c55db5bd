"""The tiny real-format fixtures: K-quant bytes against gguf-py, GGUF names and metadata,
both HF expert layouts through transformers, and llama.cpp tokenizing and failing on the same files
(every GGUF generating in llama.cpp and its F32 logits run from tests/conformance/)."""
import json
import shutil
import tempfile

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from safetensors import safe_open
from transformers import AutoTokenizer

from mawforge.fixtures import kquants
from mawforge.fixtures.gguf_writer import permute_rows, write_gguf
from mawforge.fixtures.llama_ref import LlamaRefError, llama_generate_many, llama_logits, llama_tokenize
from mawforge.fixtures.tiny import ARCHS, EXPERT_FF, HIDDEN, N_EXPERTS, N_LAYERS, load_hf, routing, tokenizer_for
from mawforge.fixtures.tokenizer import TinyTokenizer
from bounds import F32_SAME_OPS_ATOL

TEXT = "The experts stay on disk and the cache keeps them. def f(x): return x + 1"
GGUF_ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama", "olmoe": "olmoe"}


def _hf_logits(hf_dir, ids):
    with torch.no_grad():
        return load_hf(hf_dir)(torch.tensor([ids])).logits[0].numpy()


# ---- K-quants --------------------------------------------------------------------------

# Bounds: rounding to a grid of 2^b - 1 steps over a 32-value block's range (~4.5 sigma for
# Gaussian data) gives a relative RMSE of 4.5 / (2^b - 1) / sqrt(12): Q4_K 0.087, Q5_K 0.042,
# Q6_K 0.021 (the scale search of llama.cpp's quantizers only lowers it). The outlier sets its
# block's maximum, so it lands on the top grid level, off by the float16 super-block scale
# (25·eps16 ≈ 0.012) and half a 6-bit sub-scale step (25/63/2 ≈ 0.2): 0.5 bounds both.
@pytest.mark.parametrize("qtype, rel_rmse", [(QT.Q4_K, 0.09), (QT.Q5_K, 0.045), (QT.Q6_K, 0.025)])
def test_kquant_round_trip_through_gguf_dequantize(qtype, rel_rmse):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 512)).astype(np.float32) * 0.1
    x[1] = np.abs(x[1]) + 0.5          # all positive: the min term must be zero
    x[2] = -np.abs(x[2]) - 0.5         # all negative
    x[3] = 0.0                         # all zero: must come back exactly
    x[4, 7] = 25.0                     # one outlier dominates its super-block
    raw = kquants.quantize(x, qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    assert raw.dtype == np.uint8 and raw.shape == (6, 512 // block * size)
    y = gguf.quants.dequantize(raw, qtype)
    assert y.shape == x.shape
    assert np.all(y[3] == 0.0)
    for row in (0, 1, 2, 5):
        err = np.sqrt(np.mean((y[row] - x[row]) ** 2)) / np.sqrt(np.mean(x[row] ** 2))
        assert err < rel_rmse, (row, err)
    assert abs(y[4, 7] - 25.0) < 0.5


def test_kquant_rejects_rows_not_multiple_of_256():
    with pytest.raises(ValueError, match="multiple of 256"):
        kquants.quantize(np.zeros((2, 128), np.float32), QT.Q4_K)


# ---- tokenizers ------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_tokenizer_is_deterministic_and_loads_in_transformers(kind, tmp_path):
    first = TinyTokenizer.registry[kind].train(1024)
    again = TinyTokenizer.registry[kind].train(1024)
    assert first.tokens() == again.tokens() and first.merges() == again.merges()
    first.save_hf(tmp_path)
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    assert hf(TEXT).input_ids == first.tokenizer.encode(TEXT).ids
    assert hf.decode(hf(TEXT).input_ids, skip_special_tokens=True) == TEXT


@pytest.mark.parametrize("arch, expected", [
    ("qwen3_moe", "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"),
    ("mixtral", "<s>[INST] Hi [/INST]"),
])
def test_chat_template_renders(fixtures_root, arch, expected):
    hf = AutoTokenizer.from_pretrained(str(fixtures_root[arch]["hf"]))
    text = hf.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text == expected


# ---- HF directories ----------------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
def test_hf_layouts_load_with_identical_logits(fixtures_root, arch):
    entry = fixtures_root[arch]
    with safe_open(entry["hf"] / "model.safetensors", "np") as f:
        legacy = set(f.keys())
    with safe_open(entry["hf_fused"] / "model.safetensors", "np") as f:
        fused = {k: f.get_slice(k).get_shape() for k in f.keys()}
    moe = "block_sparse_moe" if arch == "mixtral" else "mlp"
    gate = "w1" if arch == "mixtral" else "gate_proj"
    assert f"model.layers.0.{moe}.experts.{N_EXPERTS - 1}.{gate}.weight" in legacy
    assert fused["model.layers.0.mlp.experts.gate_up_proj"] == [N_EXPERTS, 2 * EXPERT_FF, HIDDEN]
    assert fused["model.layers.0.mlp.experts.down_proj"] == [N_EXPERTS, HIDDEN, EXPERT_FF]
    ids = tokenizer_for(arch).tokenizer.encode(TEXT).ids
    torch.testing.assert_close(_hf_logits(entry["hf"], ids), _hf_logits(entry["hf_fused"], ids),
                               atol=F32_SAME_OPS_ATOL, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_routing_varies_across_positions(fixtures_root, arch):
    ids = tokenizer_for(arch).tokenizer.encode(TEXT).ids
    per_layer = routing(load_hf(fixtures_root[arch]["hf"]), ids)
    assert len(per_layer) == N_LAYERS
    assert all(len(set(layer)) >= len(ids) // 3 for layer in per_layer), [len(set(x)) for x in per_layer]


# ---- GGUF files ------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
def test_gguf_names_metadata_and_q4_k_m_mix(fixtures_root, arch):
    reader = gguf.GGUFReader(fixtures_root[arch]["gguf"]["Q4_K_M"])
    name = GGUF_ARCH[arch]
    fields = {k: f.contents() for k, f in reader.fields.items()}
    assert fields["general.architecture"] == name and fields["general.file_type"] == 15
    for key in ("context_length", "embedding_length", "block_count", "feed_forward_length", "expert_count",
                "expert_used_count", "attention.head_count", "attention.head_count_kv", "rope.freq_base",
                "attention.layer_norm_rms_epsilon", "attention.key_length"):
        assert f"{name}.{key}" in fields, key
    assert fields[f"{name}.expert_count"] == N_EXPERTS and fields[f"{name}.block_count"] == N_LAYERS
    assert fields["tokenizer.ggml.model"] == ("llama" if arch == "mixtral" else "gpt2")
    assert len(fields["tokenizer.ggml.tokens"]) == tokenizer_for(arch).vocab_size
    tensors = {t.name: t for t in reader.tensors}
    gate = tensors["blk.0.ffn_gate_exps.weight"]
    assert list(gate.shape) == [HIDDEN, EXPERT_FF, N_EXPERTS]     # ne order: row length first
    assert tensors["blk.0.ffn_gate_inp.weight"].tensor_type == QT.F32
    assert tensors["blk.0.attn_norm.weight"].tensor_type == QT.F32
    assert tensors["output.weight"].tensor_type == QT.Q6_K and tensors["blk.0.attn_v.weight"].tensor_type == QT.Q6_K
    downs = {tensors[f"blk.{i}.ffn_down_exps.weight"].tensor_type for i in range(N_LAYERS)}
    assert downs == {QT.Q4_K, QT.Q5_K, QT.Q6_K}
    assert ("blk.0.ffn_gate_inp_shexp.weight" in tensors) == (arch == "qwen2_moe")
    assert ("blk.0.attn_k_norm.weight" in tensors) == (arch in ("qwen3_moe", "olmoe"))


def test_gguf_f32_holds_hf_weights_with_llama_permutation(fixtures_root):
    reader = gguf.GGUFReader(fixtures_root["mixtral"]["gguf"]["F32"])
    tensors = {t.name: np.asarray(t.data) for t in reader.tensors}
    with safe_open(fixtures_root["mixtral"]["hf"] / "model.safetensors", "np") as f:
        q = f.get_tensor("model.layers.1.self_attn.q_proj.weight")
        w2 = f.get_tensor("model.layers.1.block_sparse_moe.experts.5.w2.weight")
    assert np.array_equal(tensors["blk.1.attn_q.weight"], permute_rows(q, 4))
    assert np.array_equal(tensors["blk.1.ffn_down_exps.weight"][5], w2)


def test_fused_hf_layout_converts_to_the_same_gguf(fixtures_root, tmp_path):
    entry = fixtures_root["qwen2_moe"]
    a = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(entry["gguf"]["F16"]).tensors}
    b = {t.name: np.asarray(t.data)
         for t in gguf.GGUFReader(write_gguf(entry["hf_fused"], tmp_path / "f.gguf", "F16")).tensors}
    assert a.keys() == b.keys()
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_tied_embeddings_write_no_output_tensor(fixtures_root, tmp_path):
    hf = tmp_path / "tied"
    shutil.copytree(fixtures_root["qwen3_moe"]["hf"], hf)
    cfg = json.loads((hf / "config.json").read_text()) | {"tie_word_embeddings": True}
    (hf / "config.json").write_text(json.dumps(cfg))
    names = {t.name for t in gguf.GGUFReader(write_gguf(hf, tmp_path / "tied.gguf", "Q8_0")).tensors}
    assert "token_embd.weight" in names and "output.weight" not in names


# ---- llama.cpp on the same files ------------------------------------------------------------

@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_llama_cpp_tokenizes_like_the_hf_tokenizer(fixtures_root, arch):
    text = TEXT + " <|im_start|>user\nHi<|im_end|>" if arch != "mixtral" else TEXT
    assert llama_tokenize(fixtures_root[arch]["gguf"]["Q8_0"], text) == tokenizer_for(arch).tokenizer.encode(text).ids


def test_llama_ref_reports_a_broken_file_and_leaves_no_scratch(fixtures_root, tmp_path, monkeypatch):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # where the child's request and answer go
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(fixtures_root["olmoe"]["gguf"]["Q8_0"].read_bytes()[:100_000])
    with pytest.raises(LlamaRefError, match="failed") as err:
        llama_generate_many([broken], "Hi", max_tokens=2)
    assert err.value.stderr
    gguf = fixtures_root["olmoe"]["gguf"]["Q8_0"]
    logits = llama_logits(gguf, llama_tokenize(gguf, "Hello there"))
    assert logits.ndim == 2 and np.isfinite(logits).all()
    assert list(scratch.iterdir()) == []  # a failed call and a logits call (a .npy answer) both cleaned up
