"""The attention front: model code calls this; the step's backend (from the forward context) does the work."""

from __future__ import annotations

import torch
from torch import nn

from agentbox.layers.context import get_forward_context


class Attention(nn.Module):
    """sliding_window W: a query at absolute position p sees keys p-W+1 .. p (transformers' gpt-oss mask,
    `kv_idx > q_idx - sliding_window`, is the same convention). The KV cache still keeps every position:
    the window is a mask, so the radix cache reuses the whole history. sinks: [num_heads] learned logits
    (this rank's heads) that join each row's softmax denominator and add no value (gpt-oss)."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        layer_id: int,
        sliding_window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.layer_id = layer_id
        self.sliding_window = sliding_window
        # The owning attention module registers `sinks` as its parameter first, so the checkpoint name is
        # `self_attn.sinks`; here it is only referenced.
        self.sinks = sinks

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, H, D] (or [T, H*D]); k, v: [T, Hkv, D] (or flat). Returns [T, H*D]."""
        t = q.shape[0]
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        out = get_forward_context().backend.forward(
            self.layer_id, q, k, v, sliding_window=self.sliding_window, sinks=self.sinks, scale=self.scale
        )
        return out.reshape(t, self.num_heads * self.head_dim)
