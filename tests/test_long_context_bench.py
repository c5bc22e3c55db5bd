"""benchmarks/long_context.py's instrument, on the shipped demo model: both engines start decode
from the same synthetic cache of N positions (MawForge's KV rows, llama.cpp's sequence state in
its own file format), so the same token at position N gives both the same greedy next token, and
llama.cpp's cache then holds N + 1 cells; a state file that is not what llama.cpp writes is refused."""
from __future__ import annotations

import types

import pytest

from helpers import bench_module
from mawforge.demo import demo_gguf
from mawforge.pack.packer import pack



# llama.cpp's values transposed in its cache or not (flash attention), and both caches in q8_0 (the demo's
# heads of 64: both engines hold the rows of rotated keys and values, kernels/q8_0.py)
@pytest.mark.parametrize("flash_attn,kv_dtype", [(False, None), (True, None), (True, "q8_0")])
def test_both_engines_decode_the_same_token_after_the_same_synthetic_context(tmp_path, flash_attn, kv_dtype):
    import llama_cpp
    fs = bench_module("fullsize")
    gguf = demo_gguf("Q4_K_M")
    pk = tmp_path / "pack"
    pack(gguf, pk, progress=False)
    n = 300
    a = types.SimpleNamespace(model=str(gguf), no_repack=True, fill_context=n, prompt_tokens=1, decode_tokens=4,
                              flash_attn=flash_attn, kv_dtype=kv_dtype)
    llama = fs.LlamaEngine(a)
    llama.fill(n)
    mem = llama_cpp.llama_get_memory(llama.llm._ctx.ctx)
    assert llama_cpp.llama_memory_seq_pos_max(mem, 0) == n - 1 and llama.llm.n_tokens == n
    m = types.SimpleNamespace(pack=str(pk), fill_context=n, prompt_tokens=1, decode_tokens=4, cache_percent=100,
                              budget_gib=None, prefill_chunk=128, prefetch="none", io_threads=2, policy="s3fifo",
                              trace_out=None, route_trace=None, preload=False, kv_dtype=kv_dtype)
    maw = fs.MawEngine(m)
    try:
        maw.fill(n)
        assert maw.rt.kv.pos == n
        for tok in (1000, 2345):
            assert maw.run([tok]) == llama.run([tok])
        assert llama_cpp.llama_memory_seq_pos_max(mem, 0) == n + 1 and maw.rt.kv.pos == n + 2
    finally:
        maw.rt.close()


def test_a_state_file_of_another_layout_is_refused():
    import struct
    fs = bench_module("fullsize")
    head = struct.pack("<III", 0x67677371, 3, 0) + struct.pack("<II", 1, 0)
    with pytest.raises(RuntimeError, match="unexpected llama.cpp sequence state layout"):
        fs.SeqState.parse(head + b"\0" * 16)
    with pytest.raises(struct.error):
        fs.SeqState.parse(head[:10])


def test_the_report_puts_each_context_beside_llama_cpp():
    lc = bench_module("long_context")
    rows = [{"context": 4096, "engine": e, "status": "ok", "decode_tok_s": t, "peak_rss_bytes": 2 ** 30,
             **({"planned_F": 2 ** 31} if e != "llama" else {})}
            for e, t in (("maw", 6.0), ("llama", 4.0), ("maw@8", 3.0), ("maw", 8.0))]
    rep = lc.report(rows)[4096]
    assert rep["maw"]["decode_tok_s"] == 7.0 and rep["maw_x_llama"] == 7.0 / 4.0
    assert rep["maw@8_x_llama"] == 0.75 and rep["maw"]["planned_F_gib"] == 2.0
    assert "planned_F_gib" not in rep["llama"]
    q8 = lc.report(rows + [{"context": 4096, "engine": e, "status": "ok", "decode_tok_s": t, "peak_rss_bytes": 2 ** 30}
                           for e, t in (("maw-q8", 9.0), ("llama-q8", 2.0), ("maw-q8@8", 4.5))])[4096]
    assert q8["maw-q8_x_llama-q8"] == 4.5 and q8["maw-q8_x_maw"] == 9.0 / 7.0 and q8["maw-q8@8_x_maw@8"] == 1.5
    assert q8["maw-q8@8_x_llama"] == 4.5 / 4.0
