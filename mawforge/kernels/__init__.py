"""Matmul kernels on packed weights (cpu.py: linear, embedding_rows; native/: the C kernels).
They compute on the views the quant codecs (mawforge/codecs/) make."""
from mawforge.kernels.cpu import embedding_rows, linear  # noqa: F401
