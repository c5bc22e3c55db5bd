"""Shared test fixtures: the tiny real-format models, built once per session."""
import pytest

from mawforge.fixtures.build import build_fixtures


@pytest.fixture(scope="session")
def fixtures_root(tmp_path_factory) -> dict:
    """{arch: {"hf": Path, "hf_fused": Path, "gguf": {ftype: Path}}} for every fixture arch and ftype."""
    return build_fixtures(tmp_path_factory.mktemp("fixtures"))


@pytest.fixture(scope="session")
def packs(fixtures_root, tmp_path_factory) -> dict:
    """{(arch, source): pack dir} for source in hf, hf_fused and each GGUF ftype, packed lazily."""
    from mawforge.pack.packer import pack

    root = tmp_path_factory.mktemp("packs")
    made: dict = {}

    class Packs(dict):
        def __missing__(self, key):
            arch, source = key
            fx = fixtures_root[arch]
            src = fx[source] if source in ("hf", "hf_fused") else fx["gguf"][source]
            out = root / f"{arch}-{source}"
            pack(src, out, progress=False)
            self[key] = out
            return out

    return Packs(made)
