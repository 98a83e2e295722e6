"""Unquantised experts: every expert's weights in the model dtype."""

from __future__ import annotations

import torch

from agentbox.layers.experts.base import ExpertLayer, ExpertMethod, expert_activation, moe_ref


class UnquantizedExperts(ExpertMethod):
    """Experts in the model dtype: w13 [E, 2I/tp, H], w2 [E, H, I/tp]."""

    def create_weights(self, layer: ExpertLayer) -> None:
        e, h, i = layer.num_experts, layer.hidden_size, layer.intermediate_local
        layer.add_expert_param("w13_weight", torch.empty(e, layer.w13_rows, h))
        layer.add_expert_param("w2_weight", torch.empty(e, h, i))

    def apply(self, layer: ExpertLayer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        w13, w2 = layer.w13_weight, layer.w2_weight
        b13, b2 = layer.w13_bias, layer.w2_bias if layer.tp_rank == 0 else None

        act = expert_activation(layer)
        if x.is_cuda:  # the Triton grouped GEMM (kernels/fused_moe.py); its twin is the loop below
            from agentbox.kernels.fused_moe import fused_moe, triton_available

            if triton_available():
                return fused_moe(x, w13, w2, topk_weights, topk_ids, act, b13, b2)
        return moe_ref(
            x, topk_weights, topk_ids, lambda e: (w13[e], w2[e]), layer.activation, b13, b2,
            layer.swiglu_alpha, layer.swiglu_limit,
        )
