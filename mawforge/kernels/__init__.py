"""Matmul kernels on packed weights (cpu.py: linear, embedding_rows) and torch dequantizers
(dequant.py). Names load lazily so that formats.quants can import dequant without a cycle."""


def __getattr__(name: str):
    if name in ("linear", "embedding_rows"):
        from mawforge.kernels import cpu
        return getattr(cpu, name)
    raise AttributeError(name)
