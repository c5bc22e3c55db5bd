"""Dependencies go one way: formats and text -> quant codecs -> kernels -> models -> cache -> engine ->
serve/bench/trace. Every `import` in mawforge/ counts, module-level or inside a function, so no
lazy import can hide a cycle. An architecture file (mawforge/archs/<name>.py) is torch-free
formats-level code, except the body of its `model()`, which is model code."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "mawforge"

# Longest prefix wins. Equal ranks may import each other; a lower rank never imports a higher one.
LAYERS = {
    "mawforge": 0, "mawforge.errors": 0,
    "mawforge.archs": 1, "mawforge.formats": 1, "mawforge.byte_rules": 1,
    "mawforge.text": 1,              # tokenizers, chat templates, tool-call formats: torch-free, errors only
    "mawforge.codecs": 2, "mawforge.pack": 2.5,
    "mawforge.kernels": 3,
    "mawforge.models": 4,
    "mawforge.plan": 5, "mawforge.cache": 5,
    "mawforge.trace.record": 5,      # the route-trace format the live cache writes and replay reads
    "mawforge.engine": 6, "mawforge.telemetry": 6,
    "mawforge.speculative": 6.5,     # plugs into the generator's Decoder protocol
    "mawforge.serve": 7, "mawforge.bench": 7, "mawforge.trace": 7, "mawforge.cli": 7,
    "mawforge.api": 7, "mawforge.commands": 7,
    "mawforge.synth": 7, "mawforge.fixtures": 7, "mawforge.fuzz": 7, "mawforge.demo": 7,
}
MODEL_BUILDER = 4     # the rank of an architecture file's model() body


def rank(module: str) -> float:
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return LAYERS[best]


def module_of(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(tree: ast.AST):
    """(imported module, enclosing top-level function name or None, line) for every import."""
    def walk(node, fn):
        for child in ast.iter_child_nodes(node):
            inner = child.name if fn is None and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else fn
            if isinstance(child, ast.Import):
                for a in child.names:
                    yield a.name, fn, child.lineno
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                for a in child.names:      # `from pkg import sub` imports pkg.sub when it is a module
                    yield (f"{child.module}.{a.name}"
                           if (ROOT.parent / child.module.replace(".", "/") / a.name).exists()
                           or (ROOT.parent / child.module.replace(".", "/") / f"{a.name}.py").exists()
                           else child.module), fn, child.lineno
            yield from walk(child, inner)
    yield from walk(tree, None)


def test_no_import_goes_upward():
    upward = []
    for path in sorted(ROOT.rglob("*.py")):
        src = module_of(path)
        for dst, fn, line in imports(ast.parse(path.read_text())):
            if not dst.startswith("mawforge.") or dst == src:
                continue
            here = rank(src)
            if src.startswith("mawforge.archs.") and fn == "model":
                here = MODEL_BUILDER
            if rank(dst) > here:
                upward.append(f"{path.relative_to(ROOT.parent)}:{line} {src} ({here}) imports {dst} ({rank(dst)})")
    assert not upward, "imports against the layer order:\n" + "\n".join(upward)


def test_cache_does_not_compute_and_planner_is_torch_free():
    """The expert cache holds and accounts bytes; the planner and the architecture registry
    load without torch (the model code loads only when a model is built)."""
    cache = ast.parse((ROOT / "cache" / "expert_cache.py").read_text())
    names = {a.name for n in ast.walk(cache) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert not names & {"linear", "swiglu_expert", "native", "cpu"}
    code = ("import sys, mawforge.plan, mawforge.archs, mawforge.formats.config; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT.parent)
