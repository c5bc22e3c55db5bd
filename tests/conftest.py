"""Shared test fixtures: the tiny real-format models, built once per session."""
import pytest

from mawforge.fixtures.build import build_fixtures


@pytest.fixture(scope="session")
def fixtures_root(tmp_path_factory) -> dict:
    """{arch: {"hf": Path, "hf_fused": Path, "gguf": {ftype: Path}}} for every fixture arch and ftype."""
    return build_fixtures(tmp_path_factory.mktemp("fixtures"))


@pytest.fixture(scope="session")
def packs(fixtures_root, tmp_path_factory) -> dict:
    """{(arch, source): pack dir} for source in hf, hf_fused and each GGUF ftype, packed lazily
    in the default (exact) layout; {(arch, source, "int4pack"): pack dir} transcodes to int4pack."""
    from mawforge.pack.packer import pack

    root = tmp_path_factory.mktemp("packs")
    made: dict = {}

    class Packs(dict):
        def __missing__(self, key):
            if len(key) == 2:                   # the default layout shares the exact pack
                self[key] = self[(*key, "exact")]
                return self[key]
            arch, source, layout = key
            fx = fixtures_root[arch]
            src = fx[source] if source in ("hf", "hf_fused") else fx["gguf"][source]
            out = root / f"{arch}-{source}-{layout}"
            pack(src, out, layout=layout, progress=False)
            self[key] = out
            return out

    return Packs(made)
