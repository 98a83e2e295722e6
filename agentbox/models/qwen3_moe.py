"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B): Qwen3's attention (q/k norm) with a routed-experts MLP.

Router: softmax over every expert, the top k kept, renormalised when `norm_topk_prob`. A layer is sparse
when (layer + 1) % decoder_sparse_step == 0 and it is not in `mlp_only_layers`; the others keep a dense MLP
of `intermediate_size`. Checkpoints store one tensor per expert (`mlp.experts.{e}.gate_proj.weight`, or
its quantised names); the experts' format follows the checkpoint's QuantConfig, the router never is
quantised (no released FP8 / AWQ / GPTQ checkpoint quantises `mlp.gate`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from agentbox.layers.experts import ExpertShard, FusedMoE
from agentbox.layers.linear import ReplicatedLinear
from agentbox.layers.quant import QuantConfig, quant_context
from agentbox.models.base import per_expert_weights
from agentbox.models.llama import LlamaForCausalLM, LlamaMLP


class Qwen3MoeSparseBlock(nn.Module):
    def __init__(self, config: Any, prefix: str) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only silu)")
        with quant_context(QuantConfig()):
            self.gate = ReplicatedLinear(config.hidden_size, config.num_experts, bias=False, prefix=f"{prefix}.gate")
        self.experts = FusedMoE(
            config.num_experts,
            config.num_experts_per_tok,
            config.hidden_size,
            config.moe_intermediate_size,
            renormalize=bool(config.norm_topk_prob),
            prefix=f"{prefix}.experts",
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
    expert_mapping = per_expert_weights(
        "gate_proj", "up_proj", "down_proj", (ExpertShard.GATE, ExpertShard.UP, ExpertShard.DOWN)
    )

    @staticmethod
    def make_mlp(config: Any, layer_id: int) -> nn.Module:
        return Qwen3MoeSparseBlock(config, f"model.layers.{layer_id}.mlp") if is_sparse_layer(config, layer_id) else LlamaMLP(config, prefix=f"model.layers.{layer_id}.mlp")
