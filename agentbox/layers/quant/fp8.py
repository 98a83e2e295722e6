"""FP8 block-quantised weights, the Qwen3-*-FP8 / DeepSeek-V3 layout:

- `weight` float8_e4m3fn [out, in]; `weight_scale_inv` float32 [ceil(out / bo), ceil(in / bi)];
- w[o, i] = weight[o, i] * weight_scale_inv[o // bo, i // bi], with (bo, bi) = `weight_block_size`
  (128, 128 in every release so far);
config.json: quantization_config = {quant_method: fp8, fmt: e4m3, activation_scheme: dynamic,
weight_block_size: [128, 128]}.

TP shards must fall on block boundaries (the shared loader refuses others). Where the hardware has no FP8
matmul (CPU, Ampere) the weight is used weight-only: dequantised once at load on CPU (faster than
per-call conversion there, and exact), dequantised tile by tile inside the GEMM on GPU (kernels/w8a16.py).
"""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from agentbox.layers.quant.base import LinearMethod, Sharding, quant_param, register
from agentbox.layers.quant.formats import QuantMethod

if TYPE_CHECKING:
    from agentbox.layers.linear import LinearBase


class FP8Kernel(Enum):
    DENSE = "dense"  # dequantised once at load to the compute dtype
    TRITON = "triton"  # kernels/w8a16.py: fp8 bytes + block scales stay resident


def dequantize_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The reference: fp8 [out, in] x per-block scale -> fp32 [out, in]."""
    out, inp = weight.shape
    s = scale_inv.float().repeat_interleave(block[0], 0)[:out].repeat_interleave(block[1], 1)[:, :inp]
    return weight.float() * s


@register
class FP8BlockLinearMethod(LinearMethod):
    kind = QuantMethod.FP8_BLOCK

    def create_weights(self, layer: LinearBase, input_size: int, output_size: int, dtype: torch.dtype) -> None:
        bo, bi = self.config.block_size
        self.dtype = dtype
        layer.weight = quant_param(torch.empty(output_size, input_size, dtype=torch.float8_e4m3fn), Sharding(0, 1))
        scale = torch.empty(-(-output_size // bo), -(-input_size // bi), dtype=torch.float32)
        layer.weight_scale_inv = quant_param(scale, Sharding(0, 1, bo, bi))

    def dequantized_weight(self, layer: LinearBase) -> torch.Tensor:
        return dequantize_block_fp8(layer.weight.data, layer.weight_scale_inv.data, self.config.block_size)

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        device = layer.weight.device
        default = FP8Kernel.DENSE if device.type == "cpu" else FP8Kernel.TRITON
        self.kernel = self.config.kernel if isinstance(self.config.kernel, FP8Kernel) else default
        if self.kernel is FP8Kernel.DENSE:
            w = self.dequantized_weight(layer).to(self.dtype)
            del layer.weight_scale_inv
            layer.weight = quant_param(w, Sharding(None, None))

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.kernel is FP8Kernel.DENSE:
            return F.linear(x, layer.weight, bias)
        from agentbox.kernels.w8a16 import w8a16_block_matmul

        shape = x.shape
        out = w8a16_block_matmul(
            x.reshape(-1, shape[-1]), layer.weight, layer.weight_scale_inv, self.config.block_size
        ).reshape(*shape[:-1], -1)
        return out + bias if bias is not None else out
