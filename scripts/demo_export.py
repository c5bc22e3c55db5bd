"""Export the trained demo model: checkpoint -> HF directory -> F32 GGUF (the project's
fixture writer, with the demo's own tokenizer) -> Q8_0 and Q4_K_M made by llama.cpp's own
quantizer (llama_model_quantize), in a child process because llama.cpp aborts on bad input.

The shipped files are what llama-quantize would make from the F32 GGUF, not the fixture
writer's own Q4_K_M mix (which deliberately varies ffn_down types for coverage).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from demo_moe import DemoConfig, DemoMoe

NAME = "mawforge-demo-qwen3moe"
FTYPES = {"Q8_0": 7, "Q4_K_M": 15}        # llama_ftype values (LLAMA_FTYPE_MOSTLY_*)
_QUANTIZE = """
import ctypes, sys, llama_cpp
p = llama_cpp.llama_model_quantize_default_params()
p.ftype, p.nthread = int(sys.argv[3]), 1
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(p)))
"""


def load_model(work: Path) -> DemoMoe:
    model = DemoMoe(DemoConfig())
    model.load_state_dict(torch.load(work / "ckpt.pt", weights_only=False)["model"])
    return model.eval()


def write_hf(work: Path, out: Path) -> Path:
    """config.json, model.safetensors (per-expert hub names), generation_config, tokenizer."""
    from mawforge.fixtures.tokenizer import ByteBpeTokenizer
    tok = ByteBpeTokenizer.load_hf(work / "tokenizer")
    model = load_model(work)
    out.mkdir(parents=True, exist_ok=True)
    ids = dict(bos=tok.id_of(tok.bos_token), eos=tok.id_of(tok.eos_token), pad=tok.id_of(tok.pad_token))
    (out / "config.json").write_text(json.dumps(model.c.hf_config(**ids), indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": ids["bos"], "eos_token_id": ids["eos"], "pad_token_id": ids["pad"]}, indent=2))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    tok.save_hf(out)
    return out


def quantize(src: Path, dst: Path, ftype: str) -> Path:
    tmp = dst.with_name(dst.name + ".tmp")
    proc = subprocess.run([sys.executable, "-c", _QUANTIZE, str(src), str(tmp), str(FTYPES[ftype])],
                          capture_output=True, text=True)
    if proc.returncode != 0 or not tmp.exists():
        raise SystemExit(f"llama.cpp quantize to {ftype} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    os.replace(tmp, dst)
    return dst


def step_export(a) -> None:
    from mawforge.fixtures.gguf_writer import write_gguf
    from mawforge.fixtures.tokenizer import ByteBpeTokenizer
    hf = write_hf(a.work, a.work / "hf")
    f32 = write_gguf(hf, a.work / f"{NAME}-F32.gguf", "F32", tokenizer=ByteBpeTokenizer.load_hf(hf), name=NAME)
    a.out.mkdir(parents=True, exist_ok=True)
    for ftype in FTYPES:
        path = quantize(f32, a.out / f"{NAME}-{ftype}.gguf", ftype)
        print(f"{path}: {path.stat().st_size / 2**20:.2f} MiB")
    for name in ("tokenizer.json", "tokenizer_config.json"):     # the vocabulary, for `tokenizers` users and tests
        shutil.copy(hf / name, a.out / name)
