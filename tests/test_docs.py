"""The README and docs/ link only to files that exist, and docs/index.md lists every page."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _pages() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md")),
            ROOT / "benchmarks" / "RESULTS.md"]


def test_relative_links_resolve():
    broken = []
    for page in _pages():
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue                       # a URL or an anchor in the same page
            path = (page.parent / target.split("#", 1)[0]).resolve()
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif not path.is_relative_to(ROOT):
                broken.append(f"{page.relative_to(ROOT)}: {target} points outside the repository")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_docs_index_lists_every_page():
    index = (ROOT / "docs" / "index.md").read_text()
    listed = set(LINK.findall(index))
    missing = [p.name for p in (ROOT / "docs").glob("*.md") if p.name != "index.md" and p.name not in listed]
    assert not missing, f"docs/index.md does not list: {missing}"


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200
