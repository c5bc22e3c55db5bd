"""The project's own fuzzer, a few hundred seeded cases (mawforge/fuzz): mutated GGUF files,
safetensors directories, config/index JSON, pack JSON and bytes, each through the code behind
inspect, pack and verify in a forked child capped at 4 GiB of address space and 20 s; and
single bytes flipped inside every digest-covered range of a pack, each of which verify must
find. `python scripts/fuzz.py --cases N` runs any number of them."""
from __future__ import annotations

import pytest

from mawforge.fuzz.cases import run_case
from mawforge.fuzz.runner import BAD, Fuzzer, build_seeds, summarize

CASES = 320


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    return build_seeds(tmp_path_factory.mktemp("fuzz_seeds"), archs=("qwen3_moe",))


def test_fuzz_cases_end_cleanly_and_every_flipped_byte_is_found(seeds, tmp_path):
    results = Fuzzer(seeds, tmp_path, master_seed=20261201, jobs=2).run(range(CASES))
    s = summarize(results)
    assert s["cases"] == CASES
    assert s["bad"] == [], "\n".join(f"case {r['case']} {r['kind']} {r['class']}: {r.get('desc')} -> {r['detail']}"
                                     for r in s["bad"][:10])
    assert set(s["by_kind"]) == {"gguf", "hf", "pack", "flip"}
    for kind in ("gguf", "hf", "pack"):            # the mutators reach both refusals and harmless edits
        assert s["by_kind"][kind].get("clean", 0) > 0
    assert s["by_kind"]["gguf"].get("accepted", 0) > 0 and s["by_kind"]["hf"].get("accepted", 0) > 0
    assert s["by_kind"]["flip"].get("found", 0) >= CASES // 4 - 10      # a few may be harmless JSON whitespace


def test_a_case_is_replayable_by_its_number(seeds, tmp_path):
    """The same master seed and case number give the same mutation and outcome."""
    out = []
    for n in ("a", "b"):
        (tmp_path / n).mkdir()
        out.append(run_case("hf", seeds, tmp_path / n, 7, 11))
    a, b = out
    assert a["desc"] == b["desc"] and a["class"] == b["class"] and a["class"] not in BAD
