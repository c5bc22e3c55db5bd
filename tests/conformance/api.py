"""The one place the conformance harness imports MawForge: fixture builders, the runtime and
the pack/plan readers. When modules move (issue 16, items 1-3), fix the paths here only."""
from __future__ import annotations

from typing import Callable, NamedTuple

from mawforge.engine.generate import generate
from mawforge.engine.runtime import Runtime, RuntimeOptions
from mawforge.engine.sampling import Sampler, SamplingParams
from mawforge.speculative.decode import SpecOptions, Speculator
from mawforge.errors import BudgetRejected, MawError, UnsupportedError
from mawforge.fixtures import families_ds_oss as ds_oss
from mawforge.fixtures import families_qwen35_gemma4 as q35_gemma4
from mawforge.fixtures import family_glm4moe as glm4moe
from mawforge.fixtures import family_llama4 as llama4
from mawforge.fixtures import family_qwen3next as qwen3next
from mawforge.fixtures import tiny
from mawforge.fixtures.gguf_writer import write_gguf as tiny_write_gguf
from mawforge.fixtures.llama_ref import llama_generate_many, llama_logits
from mawforge.formats.config import from_gguf_metadata, from_hf_config
from mawforge.formats.names import hf_common
from mawforge.formats.source import open_source
from mawforge.models.kv import KVCache
from mawforge.pack.manifest import read_index, read_manifest
from mawforge.pack.packer import pack
from mawforge.plan import GiB, PackFacts, make_plan

__all__ = ["generate", "Runtime", "RuntimeOptions", "Sampler", "SamplingParams", "SpecOptions", "Speculator",
           "BudgetRejected", "MawError", "UnsupportedError", "llama_generate_many", "llama_logits",
           "from_hf_config", "hf_common", "open_source", "KVCache", "read_index", "read_manifest", "pack",
           "GiB", "PackFacts", "make_plan", "Builder", "BUILDERS", "ds_oss", "q35_gemma4", "tiny", "glm4moe",
           "llama4", "from_gguf_metadata", "qwen3next"]


class Builder(NamedTuple):
    """How one fixture module makes a row's sources: an HF directory from a tiny random config
    (transformers), a GGUF of it (the `gguf` library), the transformers reference, an MTP layer."""
    build_hf: Callable          # (arch, out_dir, **kw) -> Path
    write_gguf: Callable        # (hf_dir, out_path, ftype) -> Path
    load_hf: Callable           # (hf_dir) -> transformers model (float32, eval)
    add_mtp: Callable | None    # (hf_dir, model) -> {module name: torch module} for a reference step


BUILDERS = {
    "tiny": Builder(tiny.build_hf, tiny_write_gguf, tiny.load_hf, None),
    "ds_oss": Builder(ds_oss.build_hf, ds_oss.write_gguf, tiny.load_hf, ds_oss.add_mtp_layer),
    "q35_gemma4": Builder(q35_gemma4.build_hf, q35_gemma4.write_gguf, q35_gemma4.load_hf, q35_gemma4.add_mtp_block),
    "glm4moe": Builder(glm4moe.build_hf, glm4moe.write_gguf, tiny.load_hf, glm4moe.add_mtp_layer),
    "llama4": Builder(llama4.build_hf, llama4.write_gguf, tiny.load_hf, None),
    "qwen3next": Builder(qwen3next.build_hf, qwen3next.write_gguf, qwen3next.load_hf, qwen3next.add_mtp_block),
}
