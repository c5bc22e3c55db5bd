"""Each layer's tensors, bound once at load: the per-step code reads `self.layers[layer][suffix]`
(a dict lookup) instead of formatting `blk.{layer}.{suffix}` and looking it up by name on every
token. A missing or mis-ranked required tensor fails here, naming it, instead of mid-decode."""
from __future__ import annotations

import re

from mawforge.formats.config import ModelConfig
from mawforge.formats.required import check_required
from mawforge.kernels import linear

_BLK = re.compile(r"blk\.(\d+)\.(.+)$")


class LayerWeights(dict):
    """suffix -> the tensor a block computes with (CommonWeights.bind: its float32 copy if the
    tensor is kept dense, else the packed view; the same objects, so the same bits). Every
    `blk.N.` tensor of the pack is here, required or optional: `suffix in w` is the presence
    test (a missing attn_v, a shared expert, a router correction bias)."""

    def proj(self, suffix: str, x):
        """x @ <suffix>.T plus its bias where the pack has one: MoETransformer.proj on the bound
        tensors (the same weights, the same arithmetic)."""
        y = linear(x, self[suffix])
        b = self.get(suffix.replace(".weight", ".bias"))
        return y if b is None else y + b


def bind_layers(cfg: ModelConfig, weights) -> list[LayerWeights]:
    """One LayerWeights per layer index in the pack (the decoder's n_layers and any MTP layers
    after them), after checking the architecture's required tensors (its `required`)."""
    check_required(cfg, weights.records)
    layers = [LayerWeights() for _ in range(cfg.n_layers)]
    for name in weights.records:
        m = _BLK.match(name)
        if m:
            layer = int(m.group(1))
            layers.extend(LayerWeights() for _ in range(layer + 1 - len(layers)))
            layers[layer][m.group(2)] = weights.bind(name)
    return layers
