"""FP8 block-128 experts (Qwen3-*-FP8), kept quantised in memory; the torch reference dequantises only the
experts a forward routes to."""

from __future__ import annotations

from collections.abc import Callable

import torch

from agentbox.layers.experts.base import (
    ExpertLayer,
    ExpertMethod,
    add_sharded_param,
    check_dims,
    expert_activation,
    fused_kernel,
    moe_ref,
)
from agentbox.layers.quant.base import QuantConfig, Sharding
from agentbox.layers.quant.fp8 import dequantize_block_fp8


class Fp8BlockExperts(ExpertMethod):
    """FP8 block experts as Qwen3-*-FP8 stores them (HELPERS contract 2): per expert `weight` e4m3
    [out, in] and `weight_scale_inv` float32 [out / bo, in / bi]. Weight-only (w8a16): the fp8 bytes stay
    resident on every device, CPU included: a 30B MoE dequantised once at load would need 61 GB in bf16,
    while a token reads only its top-k experts, which the reference dequantises per call."""

    def __init__(self, config: QuantConfig) -> None:
        self.block = config.block_size

    def create_weights(self, layer: ExpertLayer) -> None:
        bo, bi = self.block
        if bo != bi:
            raise ValueError(f"FP8 experts need square blocks (weight_block_size {list(self.block)})")
        check_dims(layer, bo, f"FP8 block-{bo}")
        e, h, i = layer.num_experts, layer.hidden_size, layer.intermediate_local
        f8 = torch.float8_e4m3fn
        add_sharded_param(layer, "w13_weight", torch.empty(e, layer.w13_rows, h, dtype=f8), Sharding(0, 1))
        add_sharded_param(
            layer, "w13_weight_scale_inv", torch.empty(e, layer.w13_rows // bo, h // bi), Sharding(0, 1, bo, bi)
        )
        add_sharded_param(layer, "w2_weight", torch.empty(e, h, i, dtype=f8), Sharding(0, 1))
        add_sharded_param(layer, "w2_weight_scale_inv", torch.empty(e, h // bo, i // bi), Sharding(0, 1, bo, bi))

    def fused(
        self, layer: ExpertLayer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
        kernel: Callable[..., torch.Tensor],
    ) -> torch.Tensor:
        """The fused kernel's call (contract 2)."""
        b13, b2 = layer.w13_bias, layer.w2_bias if layer.tp_rank == 0 else None
        return kernel(
            x, layer.w13_weight, layer.w13_weight_scale_inv, layer.w2_weight, layer.w2_weight_scale_inv,
            self.block, topk_weights, topk_ids, expert_activation(layer), b13, b2,
        )

    def apply(self, layer: ExpertLayer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and (kernel := fused_kernel("fused_moe_fp8")) is not None:
            return self.fused(layer, x, topk_weights, topk_ids, kernel)
        b13, b2 = layer.w13_bias, layer.w2_bias if layer.tp_rank == 0 else None

        def expert(e: int) -> tuple[torch.Tensor, torch.Tensor]:
            return (
                dequantize_block_fp8(layer.w13_weight[e], layer.w13_weight_scale_inv[e], self.block).to(x.dtype),
                dequantize_block_fp8(layer.w2_weight[e], layer.w2_weight_scale_inv[e], self.block).to(x.dtype),
            )

        return moe_ref(x, topk_weights, topk_ids, expert, layer.activation, b13, b2, layer.swiglu_alpha, layer.swiglu_limit)
