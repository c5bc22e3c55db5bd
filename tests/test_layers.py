"""Dependencies go one way: formats and text -> quant codecs -> kernels -> models -> cache -> engine ->
front (request parsing both take) -> api -> serve/bench/trace -> cli.
Every `import` in mawforge/ counts, module-level or inside a function, so no
lazy import can hide a cycle. An architecture is a package (mawforge/archs/<name>/): its
`__init__.py` is torch-free formats-level code, its `model.py` is model code."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "mawforge"

# The longest matching prefix wins ("*" matches one name). Equal ranks may import each other; a lower
# rank never imports a higher one.
LAYERS = {
    "mawforge": 0, "mawforge.errors": 0,
    "mawforge.archs": 1, "mawforge.formats": 1, "mawforge.byte_rules": 1,
    "mawforge.text": 1,              # tokenizers, chat templates, tool-call formats: torch-free, errors only
    "mawforge.archs.*.model": 4,     # an architecture's model class; its package's __init__ is the facts
    "mawforge.codecs": 2, "mawforge.pack": 2.5,
    "mawforge.kernels": 3,
    "mawforge.models": 4,
    "mawforge.plan": 5, "mawforge.cache": 5,
    "mawforge.trace.record": 5,      # the route-trace format the live cache writes and replay reads
    "mawforge.engine": 6, "mawforge.telemetry": 6,
    "mawforge.speculative": 6.5,     # plugs into the generator's Decoder protocol
    "mawforge.front": 6.8,           # what the Python API and the server take a request with
    "mawforge.api": 7,               # the Python API: the server stands on it, never the reverse
    "mawforge.serve": 7.5, "mawforge.bench": 7.5, "mawforge.trace": 7.5, "mawforge.commands": 7.5,
    "mawforge.cli": 8,
    "mawforge.synth": 7, "mawforge.fixtures": 7, "mawforge.fuzz": 7, "mawforge.demo": 7,
}


def matches(prefix: str, module: str) -> bool:
    want, have = prefix.split("."), module.split(".")
    return len(have) >= len(want) and all(w in ("*", h) for w, h in zip(want, have))


def rank(module: str) -> float:
    best = max((p for p in LAYERS if matches(p, module)), key=lambda p: p.count("."))
    return LAYERS[best]


def module_of(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(tree: ast.AST):
    """(imported module, line) for every import, module-level or nested in a function."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, node.lineno
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for a in node.names:      # `from pkg import sub` imports pkg.sub when it is a module
                yield (f"{node.module}.{a.name}"
                       if (ROOT.parent / node.module.replace(".", "/") / a.name).exists()
                       or (ROOT.parent / node.module.replace(".", "/") / f"{a.name}.py").exists()
                       else node.module), node.lineno


def test_no_import_goes_upward():
    upward = []
    for path in sorted(ROOT.rglob("*.py")):
        src = module_of(path)
        for dst, line in imports(ast.parse(path.read_text())):
            if not dst.startswith("mawforge.") or dst == src:
                continue
            if rank(dst) > rank(src):
                upward.append(f"{path.relative_to(ROOT.parent)}:{line} {src} ({rank(src)}) imports {dst} ({rank(dst)})")
    assert not upward, "imports against the layer order:\n" + "\n".join(upward)


def test_every_architecture_is_a_package_with_its_model_beside():
    """One rule for all: mawforge/archs/<name>/__init__.py holds the facts and ARCH,
    mawforge/archs/<name>/model.py the model class ARCH names (checked by name, not imported:
    importing it would load torch)."""
    from mawforge.archs import ARCHS

    for arch in ARCHS.values():
        module, _, cls = arch.model.partition(":")
        assert module.startswith("mawforge.archs.") and module.endswith(".model"), (arch.name, arch.model)
        path = ROOT.parent / (module.replace(".", "/") + ".py")
        assert (path.parent / "__init__.py").read_text().count("ARCH = Arch(") == 1, path.parent
        assert any(isinstance(n, ast.ClassDef) and n.name == cls for n in ast.parse(path.read_text()).body), \
            f"{path} has no module-level class {cls}"
    loose = [p.name for p in (ROOT / "archs").glob("*.py") if p.stem not in ("__init__", "spec", "_yarn")]
    assert not loose, f"architecture modules outside a package: {loose}"


def test_cache_does_not_compute_and_planner_is_torch_free():
    """The expert cache holds and accounts bytes; the planner and the architecture registry
    load without torch (the model code loads only when a model is built)."""
    cache = ast.parse((ROOT / "cache" / "expert_cache.py").read_text())
    names = {a.name for n in ast.walk(cache) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert not names & {"linear", "swiglu_expert", "native", "cpu"}
    code = ("import sys, mawforge.plan, mawforge.engine.options, mawforge.archs, mawforge.formats.config; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT.parent)
