"""bf16 / fp16 / fp32 weights as stored: the reference every other method is measured against.

On the CPU an fp32 model keeps fp16 checkpoint weights as fp16 (kernels/cpu_f16.py: half the bytes a decode step
streams, the same products), unless the model is loaded for exact numbers (`--exact-cpu`: int4's DENSE kernel) or
the kernels are unavailable; a layer whose shards are not all fp16 is widened back to the model's dtype.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from agentbox.layers.quant.base import LinearMethod, QuantLayer, Sharding, quant_param, register
from agentbox.layers.quant.formats import QuantMethod
from agentbox.layers.quant.lazy import materialize


def keeps_f16(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether `src` (a shard of the weight `dst`) is kept fp16 (see the module notes)."""
    from agentbox.kernels import cpu_f16
    from agentbox.layers.quant import int4

    if src.dtype != torch.float16 or dst.device.type != "cpu" or dst.dtype not in (torch.float32, torch.float16):
        return False
    return (int4.default_cpu_kernel() is int4.Int4Kernel.CPU_SIMD and dst.dim() == 2 and dst.shape[1] % 16 == 0
            and cpu_f16.supported(torch.empty(1, dst.shape[1], dtype=torch.float16)))


@register
class UnquantizedLinearMethod(LinearMethod):
    kind = QuantMethod.UNQUANTIZED

    def create_weights(self, layer: QuantLayer, input_size: int, output_size: int, dtype: torch.dtype) -> None:
        layer.weight = quant_param(torch.empty(output_size, input_size, dtype=dtype), Sharding(0, 1))
        self.dtype = dtype

    def load(self, layer: QuantLayer, param: nn.Parameter, loaded: Any, shard_id: str | int | None, name: str) -> None:
        if param is layer.weight and self.dtype == torch.float32:
            loaded = materialize(loaded)
            if keeps_f16(param.data, loaded):
                if param.dtype != torch.float16:  # the first shard: the fp32 placeholder is never filled
                    param.data = torch.empty(param.shape, dtype=torch.float16)
            elif param.dtype == torch.float16:  # a shard that is not fp16 after fp16 ones: widen (exactly)
                param.data = param.data.float()
        super().load(layer, param, loaded, shard_id, name)

    def apply(self, layer: QuantLayer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.weight.dtype == torch.float16 and x.dtype == torch.float32 and x.device.type == "cpu":
            from agentbox.kernels import cpu_f16

            out = cpu_f16.f16_matmul(x, layer.weight)
            return out + bias if bias is not None else out
        return F.linear(x, layer.weight, bias)

    def dequantized_weight(self, layer: QuantLayer) -> torch.Tensor:
        return layer.weight.float()
