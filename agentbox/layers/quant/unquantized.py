"""bf16 / fp16 / fp32 weights as stored: the reference every other method is measured against."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from agentbox.layers.quant.base import LinearMethod, Sharding, quant_param, register
from agentbox.layers.quant.formats import QuantMethod

if TYPE_CHECKING:
    from agentbox.layers.linear import LinearBase


@register
class UnquantizedLinearMethod(LinearMethod):
    kind = QuantMethod.UNQUANTIZED

    def create_weights(self, layer: LinearBase, input_size: int, output_size: int, dtype: torch.dtype) -> None:
        layer.weight = quant_param(torch.empty(output_size, input_size, dtype=dtype), Sharding(0, 1))

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)

    def dequantized_weight(self, layer: LinearBase) -> torch.Tensor:
        return layer.weight.float()
