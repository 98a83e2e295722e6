"""gpt-oss (20b, 120b): attention with learned sinks, sliding-window layers alternating with full ones,
q/k/v/o and router biases, yarn rope, and MoE experts with gpt-oss's clamped SwiGLU.

Routing: top-k router logits, softmax over those k (the same weights as softmax-then-renormalise).
Experts: `(clamp(up) + 1) * g * sigmoid(1.702 g)` with g = clamp(gate, max=7), gate and up interleaved in
the checkpoint's fused gate_up tensor. Checkpoints hold every expert stacked in one tensor per
projection: bf16 as [E, in, out] (`experts.gate_up_proj`), or MXFP4 as `*_blocks` / `*_scales` in
[E, out, in/32, ...] order (openai/gpt-oss-*); layers/experts/mxfp4.py keeps the latter resident as stored.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from agentbox.layers.experts import ExpertMethod, ExpertShard, FusedMoE, MoEActivation
from agentbox.layers.experts.mxfp4 import Mxfp4Experts, is_mxfp4_checkpoint
from agentbox.layers.linear import ReplicatedLinear
from agentbox.models.base import ExpertWeight
from agentbox.models.llama import LlamaForCausalLM

GATE_UP, DOWN = ExpertShard.GATE_UP_INTERLEAVED, ExpertShard.DOWN


class GptOssMoE(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.router = ReplicatedLinear(config.hidden_size, config.num_local_experts, bias=True)
        method: ExpertMethod | None = Mxfp4Experts() if is_mxfp4_checkpoint(config) else None
        self.experts = FusedMoE(
            config.num_local_experts,
            config.num_experts_per_tok,
            config.hidden_size,
            config.intermediate_size,
            renormalize=True,
            activation=MoEActivation.SWIGLU_OAI,
            bias=True,
            swiglu_alpha=float(config.swiglu_alpha),
            swiglu_limit=float(config.swiglu_limit),
            method=method,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.router(x))


class GptOssForCausalLM(LlamaForCausalLM):
    expert_mapping = (
        ExpertWeight("experts.gate_up_proj", "experts.w13_weight", GATE_UP, transposed=True),
        ExpertWeight("experts.gate_up_proj_bias", "experts.w13_bias", GATE_UP),
        ExpertWeight("experts.down_proj", "experts.w2_weight", DOWN, transposed=True),
        ExpertWeight("experts.down_proj_bias", "experts.w2_bias", DOWN),
        ExpertWeight("experts.gate_up_proj_blocks", "experts.w13_blocks", GATE_UP),
        ExpertWeight("experts.gate_up_proj_scales", "experts.w13_scales", GATE_UP),
        ExpertWeight("experts.down_proj_blocks", "experts.w2_blocks", DOWN),
        ExpertWeight("experts.down_proj_scales", "experts.w2_scales", DOWN),
    )

    @staticmethod
    def make_mlp(config: Any, layer_id: int) -> nn.Module:
        return GptOssMoE(config)
