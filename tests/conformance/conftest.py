"""Session fixtures of the conformance harness: every row's sources and packs, built once per
session and only when a test asks for them; transformers' and llama.cpp's logits cached."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mawforge.fixtures import requant

from . import api
from .cases import BY_ARCH, TOKENS, ArchCase


class Sources:
    """Lazily built sources of the table's rows, each by its architecture's fixture module
    (mawforge/fixtures/archs/<name>.py, found by the row's HF model type)."""

    def __init__(self, root: Path):
        self.root = root
        self._made: dict = {}
        self._hf_logits: dict = {}
        self._llama: dict = {}

    def _once(self, key, make):
        if key not in self._made:
            self._made[key] = make()
        return self._made[key]

    def path(self, case: ArchCase, source: str) -> Path:
        """The HF directory or GGUF file of one source."""
        b = api.fixture(case.arch)
        if source.startswith("mtp:"):
            hf = self.mtp(case)[0]
            src = source[4:]
            if src == "hf":
                return hf
            out = self.root / f"{case.arch}-mtp-{src}.gguf"
            return self._once((case.arch, source), lambda: b.write_gguf(hf, out, src))
        if source.startswith("hf"):
            kw = {source[3:]: True} if source != "hf" else {}      # hf_yarn: build_hf(..., yarn=True)
            out = self.root / f"{case.arch}-{source}"
            return self._once((case.arch, source), lambda: b.build_hf(case.arch, out, **kw))
        out = self.root / f"{case.arch}-{source}.gguf"
        if source in requant.names() and source not in ("F32", "F16", "Q8_0", "Q4_K_M"):
            # the quant types the fixture writer does not write: llama.cpp's own quantizer on its F32 file
            f32 = self.path(case, "F32")
            return self._once((case.arch, source), lambda: requant.quantize_gguf(f32, out, source, threads=1))
        hf = self.path(case, "hf")
        return self._once((case.arch, source), lambda: b.write_gguf(hf, out, source))

    def pack(self, case: ArchCase, source: str, layout: str = "exact") -> Path:
        src = self.path(case, source)
        out = self.root / f"pack-{case.arch}-{source.replace(':', '-')}-{layout}"
        return self._once(("pack", case.arch, source, layout),
                          lambda: (api.pack(src, out, layout=layout, progress=False), out)[1])

    def mtp(self, case: ArchCase):
        """(HF directory with an MTP layer, the transformers model, the MTP layer's modules)."""
        def make():
            b = api.fixture(case.arch)
            hf = b.build_hf(case.arch, self.root / f"{case.arch}-hf-mtp")
            model = b.load_hf(hf)
            return hf, model, b.add_mtp(hf, model)
        return self._once((case.arch, "mtp"), make)

    def hf_logits(self, case: ArchCase, source: str = "hf", tokens=None) -> torch.Tensor:
        """transformers' float32 logits [T, V] on the HF directory a source was made from."""
        ref = source if source.startswith("hf_") and source != "hf_fused" else "hf"   # GGUFs, hf_fused: hf's weights
        tokens = TOKENS if tokens is None else tuple(tokens)
        key = (case.arch, ref, tokens)
        if key not in self._hf_logits:
            model = api.fixture(case.arch).load_hf(self.path(case, ref))
            with torch.no_grad():
                self._hf_logits[key] = model(torch.tensor([list(tokens)])).logits[0].float()
        return self._hf_logits[key]

    def llama(self, case: ArchCase, ftype: str, tokens, n_batch: int = 512, **kw):
        """llama.cpp's teacher-forced logits [T, V] (numpy) on one GGUF, in a child process
        (kw: llama_logits' cache_type, attn_rot)."""
        key = (case.arch, ftype, tuple(tokens), n_batch, tuple(sorted(kw.items())))
        if key not in self._llama:
            self._llama[key] = api.llama_logits(self.path(case, ftype), list(tokens), n_ctx=320, n_batch=n_batch, **kw)
        return self._llama[key]


@pytest.fixture(scope="session")
def sources(tmp_path_factory) -> Sources:
    return Sources(tmp_path_factory.mktemp("conformance"))


@pytest.fixture
def one_thread():
    """MTP drafting tests ran on one torch thread in tests/test_mtp.py; kept so."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def case(arch: str) -> ArchCase:
    return BY_ARCH[arch]
