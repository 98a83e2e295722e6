"""MXFP4 experts (OCP microscaling FP4), resident as stored in the openai/gpt-oss checkpoints.

Layout per expert and projection, rows = output features: `*_blocks` uint8 [out, in/32, 16] (32 FP4 E2M1
values per block, two per byte, low nibble first) and `*_scales` uint8 [out, in/32] (a shared power-of-two
exponent per block, biased by 127). 4.25 bits per weight stay 4.25 bits in memory: gpt-oss-20b's experts
are ~12 GiB as MXFP4 against ~39 GiB in bf16. On CUDA with Triton the experts run through the fused-MoE
kernel that decodes MXFP4 tile by tile (kernels/fused_moe_quant.py); elsewhere the reference dequantises
only the experts a forward routes to, one at a time. The format's definition is kernels/dequant.py.
"""

from __future__ import annotations

from typing import Any

import torch

from agentbox.kernels.dequant import MXFP4_BLOCK as BLOCK
from agentbox.kernels.dequant import dequant_mxfp4
from agentbox.layers.experts.base import ExpertLayer, ExpertMethod, expert_activation, moe_ref

__all__ = ["BLOCK", "Mxfp4Experts", "dequant_mxfp4", "is_mxfp4_checkpoint", "kernel_runs"]


def is_mxfp4_checkpoint(config: Any) -> bool:
    qc = getattr(config, "quantization_config", None)
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    return str(method).lower() == "mxfp4"


def kernel_runs(x: torch.Tensor) -> bool:
    """Whether the fused MXFP4 kernel takes this forward (CUDA and Triton; a test forces it on CPU)."""
    if not x.is_cuda:
        return False
    from agentbox.kernels.fused_moe import triton_available

    return triton_available()


class Mxfp4Experts(ExpertMethod):
    def create_weights(self, layer: ExpertLayer) -> None:
        e, h, i = layer.num_experts, layer.hidden_size, layer.intermediate_local
        for what, n in (("hidden size", h), ("expert intermediate size per rank", i)):
            if n % BLOCK:
                raise ValueError(f"MXFP4 experts need the {what} ({n}) to be a multiple of {BLOCK}")
        u8 = torch.uint8
        layer.add_expert_param("w13_blocks", torch.empty(e, layer.w13_rows, h // BLOCK, BLOCK // 2, dtype=u8))
        layer.add_expert_param("w13_scales", torch.empty(e, layer.w13_rows, h // BLOCK, dtype=u8))
        layer.add_expert_param("w2_blocks", torch.empty(e, h, i // BLOCK, BLOCK // 2, dtype=u8))
        layer.add_expert_param("w2_scales", torch.empty(e, h, i // BLOCK, dtype=u8))

    def apply(self, layer: ExpertLayer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        b2 = layer.w2_bias if layer.tp_rank == 0 else None
        if kernel_runs(x):
            from agentbox.kernels.fused_moe_quant import fused_moe_mxfp4

            act = expert_activation(layer)
            return fused_moe_mxfp4(
                x, layer.w13_blocks, layer.w13_scales, layer.w2_blocks, layer.w2_scales,
                topk_weights, topk_ids, act, layer.w13_bias, b2,
            )

        def expert(e: int) -> tuple[torch.Tensor, torch.Tensor]:
            return (
                dequant_mxfp4(layer.w13_blocks[e], layer.w13_scales[e], x.dtype),
                dequant_mxfp4(layer.w2_blocks[e], layer.w2_scales[e], x.dtype),
            )

        return moe_ref(
            x, topk_weights, topk_ids, expert, layer.activation, layer.w13_bias, b2,
            layer.swiglu_alpha, layer.swiglu_limit,
        )
