"""qwen2moe's model class (torch): see mawforge/archs/qwen2moe/__init__.py for the facts."""
from __future__ import annotations

import torch

from mawforge.kernels import linear
from mawforge.models.base import MoETransformer


class Qwen2Moe(MoETransformer):
    def beside_experts(self, layer: int, h: torch.Tensor) -> torch.Tensor | None:
        lw = self.layers[layer]
        if "ffn_gate_shexp.weight" not in lw:
            return None
        g = linear(h, lw["ffn_gate_shexp.weight"]).float()          # [T, F_sh]
        u = linear(h, lw["ffn_up_shexp.weight"]).float()
        y = linear(torch.nn.functional.silu(g) * u, lw["ffn_down_shexp.weight"]).float()
        gate = torch.sigmoid(h @ lw["ffn_gate_inp_shexp.weight"].T)  # [T, 1]
        return gate * y
