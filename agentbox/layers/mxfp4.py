"""MXFP4 experts (OCP microscaling FP4), resident as stored in the openai/gpt-oss checkpoints.

Layout per expert and projection, rows = output features: `*_blocks` uint8 [out, in/32, 16] (32 FP4 E2M1
values per block, two per byte, low nibble first) and `*_scales` uint8 [out, in/32] (a shared power-of-two
exponent per block, biased by 127). 4.25 bits per weight stay 4.25 bits in memory: gpt-oss-20b's experts
are ~12 GiB as MXFP4 against ~39 GiB in bf16. The reference here dequantises only the experts a forward
routes to, one at a time; a fused MXFP4 kernel is a GPU follow-up.
"""

from __future__ import annotations

from typing import Any

import torch

from agentbox.layers.moe import ExpertMethod, FusedMoE, moe_ref

BLOCK = 32  # values per scale
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def is_mxfp4_checkpoint(config: Any) -> bool:
    qc = getattr(config, "quantization_config", None)
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    return str(method).lower() == "mxfp4"


def dequant_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks [..., G, 16] uint8, scales [..., G] uint8 -> [..., G * 32] in `dtype`."""
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    lut = torch.tensor(FP4_E2M1, dtype=torch.float32, device=blocks.device)
    values = torch.stack((lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]), dim=-1)  # [..., G, 16, 2]
    values = values.flatten(-2)  # [..., G, 32]: low nibble is the even element
    exponent = scales.to(torch.int32) - 127
    return torch.ldexp(values, exponent.unsqueeze(-1)).flatten(-2).to(dtype)


class Mxfp4Experts(ExpertMethod):
    def create_weights(self, layer: FusedMoE) -> None:
        e, h, i = layer.num_experts, layer.hidden_size, layer.intermediate_local
        for what, n in (("hidden size", h), ("expert intermediate size per rank", i)):
            if n % BLOCK:
                raise ValueError(f"MXFP4 experts need the {what} ({n}) to be a multiple of {BLOCK}")
        u8 = torch.uint8
        layer.add_expert_param("w13_blocks", torch.empty(e, 2 * i, h // BLOCK, BLOCK // 2, dtype=u8))
        layer.add_expert_param("w13_scales", torch.empty(e, 2 * i, h // BLOCK, dtype=u8))
        layer.add_expert_param("w2_blocks", torch.empty(e, h, i // BLOCK, BLOCK // 2, dtype=u8))
        layer.add_expert_param("w2_scales", torch.empty(e, h, i // BLOCK, dtype=u8))

    def apply(self, layer: FusedMoE, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        def expert(e: int) -> tuple[torch.Tensor, torch.Tensor]:
            return (
                dequant_mxfp4(layer.w13_blocks[e], layer.w13_scales[e], x.dtype),
                dequant_mxfp4(layer.w2_blocks[e], layer.w2_scales[e], x.dtype),
            )

        b2 = layer.w2_bias if layer.tp_rank == 0 else None
        return moe_ref(
            x, topk_weights, topk_ids, expert, layer.activation, layer.w13_bias, b2,
            layer.swiglu_alpha, layer.swiglu_limit,
        )
