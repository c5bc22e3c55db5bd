"""Speculative decoding: drafters (prompt lookup, a draft pack, MTP layers), verification in one
batched step with rejection sampling, and MoE-aware accounting. It plugs into the one generator
(engine/generate.py) through the decoder protocol the generator owns."""
