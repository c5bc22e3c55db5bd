"""Quant codecs, the layer between the formats and the kernels: quants.py (the storage codecs a
pack stores and `PackedWeight`) and dequant.py (bit-exact torch dequantizers of GGUF blocks).
The packer encodes with them, the kernels compute on what they view; neither imports back."""
