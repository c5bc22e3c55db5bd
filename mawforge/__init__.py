"""MawForge: run Mixture-of-Experts models larger than the memory they are given.

    import mawforge
    with mawforge.load("model.gguf", memory_budget_gib=8) as m:
        print(m.complete("Hello", max_tokens=16).text)

The front door (`load`, `plan_for`, `Model`, ...) lives in mawforge/api.py and is imported on first
use (PEP 562), so `import mawforge` stays light and the lower layers that import this package
(for __version__) never depend on the layer above them.
"""

__version__ = "0.1.0"

_API = ("load", "plan_for", "open_pack", "Model", "Completion", "ChatReply", "ModelClosed", "Busy")


def __getattr__(name: str):
    if name in _API:
        import importlib
        return getattr(importlib.import_module("mawforge.api"), name)
    raise AttributeError(f"module 'mawforge' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_API))
