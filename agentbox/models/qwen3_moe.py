"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B): Qwen3's attention (q/k norm) with a routed-experts MLP.

Router: softmax over every expert, the top k kept, renormalised when `norm_topk_prob`. A layer is sparse
when (layer + 1) % decoder_sparse_step == 0 and it is not in `mlp_only_layers`; the others keep a dense MLP
of `intermediate_size`. Checkpoints store one tensor per expert (`mlp.experts.{e}.gate_proj.weight`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from agentbox.layers.linear import ReplicatedLinear
from agentbox.layers.moe import ExpertShard, FusedMoE
from agentbox.models.llama import LlamaForCausalLM, LlamaMLP
from agentbox.models.weight_loader import ExpertWeight


class Qwen3MoeSparseBlock(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only silu)")
        self.gate = ReplicatedLinear(config.hidden_size, config.num_experts, bias=False)
        self.experts = FusedMoE(
            config.num_experts,
            config.num_experts_per_tok,
            config.hidden_size,
            config.moe_intermediate_size,
            renormalize=bool(config.norm_topk_prob),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))


def is_sparse_layer(config: Any, layer_id: int) -> bool:
    return (
        layer_id not in (config.mlp_only_layers or [])
        and config.num_experts > 0
        and (layer_id + 1) % config.decoder_sparse_step == 0
    )


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    expert_mapping = (
        ExpertWeight("experts.{e}.gate_proj.weight", "experts.w13_weight", ExpertShard.GATE),
        ExpertWeight("experts.{e}.up_proj.weight", "experts.w13_weight", ExpertShard.UP),
        ExpertWeight("experts.{e}.down_proj.weight", "experts.w2_weight", ExpertShard.DOWN),
    )

    @staticmethod
    def make_mlp(config: Any, layer_id: int) -> nn.Module:
        return Qwen3MoeSparseBlock(config) if is_sparse_layer(config, layer_id) else LlamaMLP(config)
