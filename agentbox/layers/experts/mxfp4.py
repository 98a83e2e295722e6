"""MXFP4 experts (OCP microscaling FP4), resident as stored in the openai/gpt-oss checkpoints.

Layout per expert and projection, rows = output features: `*_blocks` uint8 [out, in/32, 16] (32 FP4 E2M1
values per block, two per byte, low nibble first) and `*_scales` uint8 [out, in/32] (a shared power-of-two
exponent per block, biased by 127). 4.25 bits per weight stay 4.25 bits in memory: gpt-oss-20b's experts
are ~12 GiB as MXFP4 against ~39 GiB in bf16. On CUDA with Triton the experts run through the fused-MoE
kernel that decodes MXFP4 tile by tile (kernels/fused_moe_quant.py); elsewhere the reference dequantises
only the experts a forward routes to, one at a time. The format's definition is kernels/dequant.py.

DeepSeek-V4's release stores the same numbers per expert and projection (`experts.3.w1.weight` int8 [out, in/2],
element 2i in the low nibble; `experts.3.w1.scale` E8M0 [out, in/32]): as bytes that is gpt-oss's blocks with the
last dim unflattened, so `Mxfp4Layout.PACKED_ROWS` only views each tensor so as it loads (llama.cpp's converter,
`repack_mxfp4_blocks`, reads it the same way). The expert registry builds that layout for `QuantMethod.MXFP4`
(config `expert_dtype: fp4`); gpt-oss's model builds the blocks layout itself.
"""

from __future__ import annotations

from enum import Enum
from functools import partial
from typing import Any

import torch
from torch import nn

from agentbox.kernels.dequant import MXFP4_BLOCK as BLOCK
from agentbox.kernels.dequant import dequant_mxfp4, e8m0_bytes
from agentbox.layers.experts.base import ExpertLayer, ExpertMethod, ExpertShard, expert_activation, moe_ref
from agentbox.layers.weight_loading import set_weight_loader

__all__ = ["BLOCK", "Mxfp4Experts", "Mxfp4Layout", "dequant_mxfp4", "is_mxfp4_checkpoint", "kernel_runs"]


class Mxfp4Layout(Enum):
    BLOCKS = "blocks"  # gpt-oss: `*_blocks` uint8 [out, in/32, 16] and `*_scales` uint8 [out, in/32]
    PACKED_ROWS = "packed-rows"  # DeepSeek-V4: int8 [out, in/2] and E8M0 (uint8 or float8_e8m0fnu) [out, in/32]


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


def _load_packed_rows(layer: ExpertLayer, param: nn.Parameter, loaded: torch.Tensor, expert_id: int,
                      shard: ExpertShard) -> None:
    """One expert's packed rows (or their E8M0 scales) viewed as the blocks layout, then loaded as gpt-oss's are."""
    what = f"{layer.prefix}.{expert_id} ({shard.value})"
    if param.dim() == 4:  # codes
        if loaded.dtype not in (torch.int8, torch.uint8) or loaded.dim() != 2 or loaded.shape[1] % (BLOCK // 2):
            raise ValueError(f"{what}: FP4 experts are int8 [out, in/2] with in a multiple of {BLOCK}, "
                             f"not {loaded.dtype} {tuple(loaded.shape)}")
        loaded = loaded.view(torch.uint8).reshape(loaded.shape[0], -1, BLOCK // 2)
    else:
        try:
            loaded = e8m0_bytes(loaded)
        except ValueError as e:
            raise ValueError(f"{what} scale: {e}") from None
    layer.weight_loader(param, loaded, expert_id, shard)


class Mxfp4Experts(ExpertMethod):
    def __init__(self, layout: Mxfp4Layout = Mxfp4Layout.BLOCKS) -> None:
        self.layout = layout

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
        if self.layout is Mxfp4Layout.PACKED_ROWS:
            for name in ("w13_blocks", "w13_scales", "w2_blocks", "w2_scales"):
                set_weight_loader(getattr(layer, name), partial(_load_packed_rows, layer))

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
