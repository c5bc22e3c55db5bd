"""Qwen2-MoE (HF `qwen2_moe`, GGUF `qwen2moe`): q/k/v biases, softmax router without top-k
renormalization, and a shared expert scaled by a sigmoid gate that runs beside the routed ones."""
from __future__ import annotations

from mawforge.archs.qwen3moe import ATTN
from mawforge.archs.spec import Arch

SHARED = ("ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight")


def required(cfg, layer: int) -> tuple:
    return ATTN + ("ffn_norm.weight", "ffn_gate_inp.weight") + (SHARED if cfg.shared_ff else ())


def model() -> type:
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

    return Qwen2Moe


ARCH = Arch("qwen2moe", ("qwen2_moe",), model, order=1, required=required,
            defaults=dict(qk_norm="none", norm_topk_prob=False, rope_layout="neox", qkv_bias=True))
