"""The one place the conformance harness imports MawForge: fixture builders, the runtime and
the pack/plan readers. When modules move (issue 16, items 1-3), fix the paths here only.
A row's fixture module is found by its HF model type (`fixture`, mawforge/fixtures/archs/)."""
from __future__ import annotations

from mawforge.engine.generate import generate
from mawforge.engine.runtime import Runtime, RuntimeOptions
from mawforge.engine.sampling import Sampler, SamplingParams
from mawforge.speculative.decode import SpecOptions, Speculator
from mawforge.errors import BudgetRejected, MawError, UnsupportedError
from mawforge.fixtures.archs import for_model_type as fixture
from mawforge.fixtures.tiny import ARCHS as TINY_ARCHS
from mawforge.fixtures.llama_ref import llama_generate_many, llama_logits
from mawforge.formats.config import from_gguf_metadata, from_hf_config
from mawforge.formats.names import hf_common
from mawforge.formats.source import open_source
from mawforge.models.kv import KVCache
from mawforge.pack.manifest import read_index, read_manifest
from mawforge.pack.packer import pack
from mawforge.plan import Budget, GiB, PackFacts, make_plan

__all__ = ["generate", "Runtime", "RuntimeOptions", "Sampler", "SamplingParams", "SpecOptions", "Speculator",
           "BudgetRejected", "MawError", "UnsupportedError", "llama_generate_many", "llama_logits",
           "from_hf_config", "hf_common", "open_source", "KVCache", "read_index", "read_manifest", "pack",
           "Budget", "GiB", "PackFacts", "make_plan", "fixture", "from_gguf_metadata", "TINY_ARCHS"]

