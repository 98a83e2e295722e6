"""bf16 / fp16 / fp32 weights as stored: the reference every other method is measured against.

On the CPU an fp32 model keeps fp16 and bf16 checkpoint weights as stored (kernels/cpu_f16.py: half the bytes a
decode step streams, the same products), unless the model is loaded for exact numbers (`--exact-cpu`: int4's DENSE
kernel) or the kernels are unavailable; a layer whose shards are not all of one 16-bit type is widened back to the
model's dtype.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from agentbox.layers.quant.base import LinearMethod, QuantLayer, Sharding, quant_param, register
from agentbox.layers.quant.formats import QuantMethod
from agentbox.layers.quant.lazy import materialize


def keeps_f16(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether `src` (a shard of the weight `dst`) is kept as its 16-bit type (see the module notes): `dst` is the
    fp32 placeholder, or a weight earlier shards made that type."""
    from agentbox.kernels import cpu_f16
    from agentbox.layers.quant import int4

    if src.dtype not in cpu_f16.HALF_DTYPES or dst.device.type != "cpu" or dst.dtype not in (torch.float32, src.dtype):
        return False
    return (int4.default_cpu_kernel() is int4.Int4Kernel.CPU_SIMD and dst.dim() == 2 and dst.shape[1] % 16 == 0
            and cpu_f16.supported(torch.empty(1, dst.shape[1], dtype=src.dtype)))


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
                if param.dtype != loaded.dtype:  # the first shard: the fp32 placeholder is never filled
                    param.data = torch.empty(param.shape, dtype=loaded.dtype)
            elif param.dtype != torch.float32:  # a shard of another type after 16-bit ones: widen (exactly)
                param.data = param.data.float()
        super().load(layer, param, loaded, shard_id, name)

    def apply(self, layer: QuantLayer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from agentbox.kernels import cpu_dense, cpu_f16

        if layer.weight.dtype in cpu_f16.HALF_DTYPES and x.dtype == torch.float32 and x.device.type == "cpu":
            out = cpu_f16.f16_matmul(x, layer.weight)
            return out + bias if bias is not None else out
        return cpu_dense.linear(x, layer.weight, bias)  # F.linear off the CPU

    def dequantized_weight(self, layer: QuantLayer) -> torch.Tensor:
        return layer.weight.float()
