"""KV cache preallocated for the whole context at load, so its bytes are known up front."""
from __future__ import annotations

import torch

from mawforge.errors import RequestError


class KVCache:
    # k, v: [L, G, ctx, D]
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, context: int,
                 dtype: torch.dtype, device: torch.device):
        self.context = context
        self.k = torch.zeros(n_layers, n_kv_heads, context, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.pos = 0            # committed positions

    @staticmethod
    def bytes_for(n_layers: int, n_kv_heads: int, head_dim: int, context: int, dtype: torch.dtype) -> int:
        return 2 * n_layers * n_kv_heads * context * head_dim * torch.empty(0, dtype=dtype).element_size()

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def check_room(self, n: int) -> None:
        if self.pos + n > self.context:
            raise RequestError(f"{self.pos + n} tokens exceed the context of {self.context}")

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [T, G, D] at the uncommitted positions; return the layer's [G, S, D] views."""
        T = k.shape[0]
        end = self.pos + T
        self.k[layer, :, self.pos:end] = k.transpose(0, 1).to(self.k.dtype)
        self.v[layer, :, self.pos:end] = v.transpose(0, 1).to(self.v.dtype)
        return self.k[layer, :, :end], self.v[layer, :, :end]

    def commit(self, n: int) -> None:
        self.pos += n

    def truncate(self, n: int) -> None:
        """Forget positions >= n (speculative rollback, or a new request)."""
        self.pos = min(self.pos, n)
