"""Qwen3.8-Flash-Next's hyper-connections (transformers' `Qwen4ExpTextGatedResidual`): the residual stream is
`hc` streams side by side, [T, hc * hidden]. Before each block the streams are normed (each on its own,
zero-centred weight), a low-rank gate (silu down, sigmoid up) scales every channel of every stream, and the mean
over streams is the block's input; the block's output is added back to each stream times its own injection
weight, 2 sigmoid(w . normed / hc). At the end the same mix without the injection collapses the streams.

DeepSeek-V4's and GLM-5.3's hyper-connections (layers/hyper_connection.py) mix the streams through a
Sinkhorn-balanced matrix and weight each stream by a scalar; none of that is here, nor their unweighted norm, so
the two share nothing but the idea. Replicated on every tensor-parallel rank (the gates are small).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from agentbox.layers.linear import ReplicatedLinear
from agentbox.layers.ngram_embedding import GroupRMSNorm


class GatedResidual(nn.Module):
    def __init__(self, config: Any, prefix: str, combine: bool = True) -> None:
        super().__init__()
        self.hc, self.hidden = config.hc_count, config.hidden_size
        width = self.hc * self.hidden
        self.hc_norm = GroupRMSNorm(width, self.hidden, config.rms_norm_eps)
        self.input_mix_weight_down = ReplicatedLinear(width, config.hc_lowrank, bias=False,
                                                      prefix=f"{prefix}.input_mix_weight_down")
        self.input_mix_weight_up = ReplicatedLinear(config.hc_lowrank, width, bias=False,
                                                    prefix=f"{prefix}.input_mix_weight_up")
        self.block_inject_weight = (
            ReplicatedLinear(width, self.hc, bias=False, prefix=f"{prefix}.block_inject_weight") if combine else None
        )

    def mix(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """streams [T, hc * hidden] -> (the block's input [T, hidden], the normed streams)."""
        normed = self.hc_norm(streams)
        gate = torch.sigmoid(self.input_mix_weight_up(F.silu(self.input_mix_weight_down(normed) / self.hc)))
        mixed = (gate.unflatten(-1, (self.hc, self.hidden)) * normed.unflatten(-1, (self.hc, self.hidden))).mean(-2)
        return mixed, normed

    def forward(self, streams: torch.Tensor, block: Any) -> torch.Tensor:
        """The streams after `block` (a callable of the mixed input): each gets the output times its weight."""
        mixed, normed = self.mix(streams)
        assert self.block_inject_weight is not None
        weights = 2 * torch.sigmoid(self.block_inject_weight(normed) / self.hc)  # [T, hc]
        out = block(mixed)
        return streams + (out[:, None, :] * weights[..., None]).flatten(1)
