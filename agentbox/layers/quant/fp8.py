"""FP8 block-quantised weights, the Qwen3-*-FP8 / DeepSeek-V3 layout:

- `weight` float8_e4m3fn [out, in]; `weight_scale_inv` float32 [ceil(out / bo), ceil(in / bi)];
- w[o, i] = weight[o, i] * weight_scale_inv[o // bo, i // bi], with (bo, bi) = `weight_block_size`
  (128, 128 in every release so far);
config.json: quantization_config = {quant_method: fp8, fmt: e4m3, activation_scheme: dynamic,
weight_block_size: [128, 128]}. DeepSeek-V4's release (scale_fmt: ue8m0) stores each block's scale as one E8M0
byte in `scale` (the model renames it): a power of two, converted exactly to the fp32 scale at load.

TP shards must fall on block boundaries (the shared loader refuses others). Where the hardware has no FP8
matmul (CPU, Ampere) the weight is used weight-only: dequantised once at load on CPU (faster than
per-call conversion there, and exact), dequantised tile by tile inside the GEMM on GPU (kernels/w8a16.py).
GPUs with FP8 tensor cores (sm_89 and later) run w8a8 (kernels/w8a8_block.py): activations quantised per
token and group of 128 to e4m3, fp8 x fp8 dots, both scales applied per tile; that rounds the activations
(a few percent relative error per product, as every FP8 serving engine does), so it is that hardware's
choice only.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from agentbox.kernels.dequant import E8M0_DTYPES, e8m0_to_float
from agentbox.layers.quant.base import LinearMethod, QuantLayer, Sharding, quant_param, register
from agentbox.layers.quant.formats import QuantMethod
from agentbox.layers.quant.lazy import materialize


class FP8Kernel(Enum):
    DENSE = "dense"  # dequantised once at load to the compute dtype
    TRITON = "triton"  # kernels/w8a16.py: fp8 bytes + block scales stay resident, weight-only
    W8A8 = "w8a8"  # kernels/w8a8_block.py: fp8 activations too (FP8 tensor cores)


FP8_MATMUL_CAPABILITY = (8, 9)  # Ada (sm_89) and later have FP8 tensor cores; Ampere (sm_80/86) has none


def fp8_kernel_for(device_type: str, capability: tuple[int, int] | None) -> FP8Kernel:
    """The default kernel of a device (pure: the caller reads the capability)."""
    if device_type == "cpu":
        return FP8Kernel.DENSE
    if capability is not None and capability >= FP8_MATMUL_CAPABILITY:
        return FP8Kernel.W8A8
    return FP8Kernel.TRITON


def dequantize_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The reference: fp8 [out, in] x per-block scale -> fp32 [out, in]."""
    out, inp = weight.shape
    s = scale_inv.float().repeat_interleave(block[0], 0)[:out].repeat_interleave(block[1], 1)[:, :inp]
    return weight.float() * s


@register
class FP8BlockLinearMethod(LinearMethod):
    kind = QuantMethod.FP8_BLOCK

    def create_weights(self, layer: QuantLayer, input_size: int, output_size: int, dtype: torch.dtype) -> None:
        bo, bi = self.config.block_size
        self.dtype = dtype
        layer.weight = quant_param(torch.empty(output_size, input_size, dtype=torch.float8_e4m3fn), Sharding(0, 1))
        scale = torch.empty(-(-output_size // bo), -(-input_size // bi), dtype=torch.float32)
        layer.weight_scale_inv = quant_param(scale, Sharding(0, 1, bo, bi))

    def load(
        self, layer: QuantLayer, param: nn.Parameter, loaded: Any, shard_id: str | int | None, name: str
    ) -> None:
        """As every method loads, after two checks: the weight must be e4m3 (a bf16 tensor would be rounded to fp8
        without its scale), and E8M0 scales become their fp32 values (scales are 1/16384 of the weight: read
        whole)."""
        dtype = getattr(loaded, "dtype", None)  # a LazySlice (tensor parallel) has none: its file said fp8
        if param is layer.weight and dtype is not None and dtype != torch.float8_e4m3fn:
            raise ValueError(f"{layer.prefix}.{name}: {dtype} where an FP8 block checkpoint holds float8_e4m3fn")
        if param is getattr(layer, "weight_scale_inv", None):
            loaded = materialize(loaded)
            if loaded.dtype in E8M0_DTYPES:
                loaded = e8m0_to_float(loaded)
        super().load(layer, param, loaded, shard_id, name)

    def dequantized_weight(self, layer: QuantLayer) -> torch.Tensor:
        return dequantize_block_fp8(layer.weight.data, layer.weight_scale_inv.data, self.config.block_size)

    def process_weights_after_loading(self, layer: QuantLayer) -> None:
        device = layer.weight.device
        capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        default = fp8_kernel_for(device.type, capability)
        self.kernel = self.config.kernel if isinstance(self.config.kernel, FP8Kernel) else default
        if self.kernel is FP8Kernel.DENSE:
            w = self.dequantized_weight(layer).to(self.dtype)
            del layer.weight_scale_inv
            layer.weight = quant_param(w, Sharding(None, None))

    def apply(self, layer: QuantLayer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.kernel is FP8Kernel.DENSE:
            return F.linear(x, layer.weight, bias)
        if self.kernel is FP8Kernel.W8A8:
            from agentbox.kernels.w8a8_block import w8a8_block_matmul as matmul
        else:
            from agentbox.kernels.w8a16 import w8a16_block_matmul as matmul

        shape = x.shape
        out = matmul(x.reshape(-1, shape[-1]), layer.weight, layer.weight_scale_inv, self.config.block_size)
        out = out.reshape(*shape[:-1], -1)
        return out + bias if bias is not None else out
