"""The attention front: model code calls this; the step's backend (from the forward context) does the work."""

from __future__ import annotations

import torch
from torch import nn

from agentbox.layers.context import get_forward_context


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, layer_id: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.layer_id = layer_id

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, H, D] (or [T, H*D]); k, v: [T, Hkv, D] (or flat). Returns [T, H*D]."""
        t = q.shape[0]
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        out = get_forward_context().backend.forward(self.layer_id, q, k, v)
        return out.reshape(t, self.num_heads * self.head_dim)
