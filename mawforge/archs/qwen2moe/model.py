"""qwen2moe's model class (torch): see mawforge/archs/qwen2moe/__init__.py for the facts."""
from __future__ import annotations

import torch

from mawforge.kernels import linear
from mawforge.models.base import MoETransformer


class Qwen2Moe(MoETransformer):
    def beside_experts(self, layer: int, h: torch.Tensor) -> torch.Tensor | None:
        p = f"blk.{layer}."
        if not self.w.has(p + "ffn_gate_shexp.weight"):
            return None
        g = linear(h, self.w.packed(p + "ffn_gate_shexp.weight")).float()          # [T, F_sh]
        u = linear(h, self.w.packed(p + "ffn_up_shexp.weight")).float()
        y = linear(torch.nn.functional.silu(g) * u, self.w.packed(p + "ffn_down_shexp.weight")).float()
        gate = torch.sigmoid(h @ self.w.dense(p + "ffn_gate_inp_shexp.weight").T)  # [T, 1]
        return gate * y
