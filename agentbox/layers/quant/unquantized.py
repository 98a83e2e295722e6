"""bf16 / fp16 / fp32 weights as stored: the reference every other method is measured against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from agentbox.layers.quant.base import LinearMethod, QuantLayer, Sharding, quant_param, register
from agentbox.layers.quant.formats import QuantMethod


@register
class UnquantizedLinearMethod(LinearMethod):
    kind = QuantMethod.UNQUANTIZED

    def create_weights(self, layer: QuantLayer, input_size: int, output_size: int, dtype: torch.dtype) -> None:
        layer.weight = quant_param(torch.empty(output_size, input_size, dtype=dtype), Sharding(0, 1))

    def apply(self, layer: QuantLayer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)

    def dequantized_weight(self, layer: QuantLayer) -> torch.Tensor:
        return layer.weight.float()
