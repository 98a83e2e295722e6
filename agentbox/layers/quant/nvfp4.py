"""NVFP4 linears, in the two layouts releases ship (the same numbers under other names):

- ModelOpt (`hf_quant_config.json`, or quantization_config {quant_method: modelopt, quant_algo: NVFP4}):
  `weight` uint8 [out, in / 2], `weight_scale` float8_e4m3fn [out, in / 16], `weight_scale_2` float32 scalar,
  `input_scale` float32 scalar; w = e2m1 * weight_scale * weight_scale_2.
- compressed-tensors `nvfp4-pack-quantized` (llm-compressor): `weight_packed` uint8 [out, in / 2],
  `weight_scale` float8_e4m3fn [out, in / 16], `weight_global_scale` float32 [1] and, for W4A4 schemes,
  `input_global_scale` [1]; the global scales are divisors: w = e2m1 * weight_scale / weight_global_scale.

Two e2m1 codes a byte, input column 2j in the low nibble, 2j + 1 in the high one; a code is sign (bit 3),
two exponent bits and one mantissa bit: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6.

A fused layer (qkv, gate_up) reads several checkpoint tensors, each with its own global scale; other engines
take the largest and accept the error. Here the global scale is kept per output row (fp32 [out], 4 bytes a
row), so every shard dequantises exactly as its checkpoint says. The activation scale is one per layer (the
shards read one input; the largest is kept, as the FP4 GEMM needs one).

Kernels (`NvFp4Kernel`): on CPU the weight is dequantised once at load to the compute dtype (exact; the
existing dense kernels then run it); on GPUs with FP4 tensor cores (sm_100 / sm_120) and flashinfer, W4A4
(activations quantised per 16 on the fly with the checkpoint's input scale); on other GPUs the Triton W4A16
kernel (kernels/nvfp4.py) dequantises tiles in registers. The kernel a layer took is logged once per model.
"""

from __future__ import annotations

import logging
from enum import Enum
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from agentbox.kernels.nvfp4_codes import GROUP, dequantize_nvfp4
from agentbox.layers.quant.base import LinearMethod, QuantLayer, Sharding, quant_param, register
from agentbox.layers.quant.formats import NvFp4Layout, QuantMethod, has_fp4_tensor_cores
from agentbox.layers.quant.lazy import materialize

log = logging.getLogger(__name__)

class NvFp4Kernel(Enum):
    DENSE = "dense"  # dequantised once at load to the compute dtype (CPU; exact)
    TRITON_W4A16 = "triton-w4a16"  # kernels/nvfp4.py: codes + scales resident, dequantised per tile
    FP4_GEMM = "flashinfer-fp4"  # flashinfer's FP4 tensor-core GEMM, activations quantised to NVFP4 (W4A4)


def flashinfer_fp4_available() -> bool:
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    # the three calls kernels/nvfp4.py makes (flashinfer >= 0.2.9 exports them at the top level)
    return all(hasattr(flashinfer, f) for f in ("mm_fp4", "fp4_quantize", "nvfp4_block_scale_interleave"))


def nvfp4_kernel_for(device_type: str, capability: tuple[int, int] | None, fp4_gemm: bool) -> NvFp4Kernel:
    """The default kernel of a device (pure: the caller probes the capability and flashinfer). The FP4 GEMM
    needs the checkpoint's activation scales (`fp4_gemm` is False for NVFP4A16 releases)."""
    if device_type == "cpu":
        return NvFp4Kernel.DENSE
    if fp4_gemm and has_fp4_tensor_cores(capability):
        return NvFp4Kernel.FP4_GEMM
    return NvFp4Kernel.TRITON_W4A16


# Checkpoint names by role, per layout; the global scales of compressed-tensors are divisors.
NAMES: dict[NvFp4Layout, dict[str, str]] = {
    NvFp4Layout.MODELOPT: {"codes": "weight", "scale": "weight_scale", "global": "weight_scale_2", "input": "input_scale"},
    NvFp4Layout.COMPRESSED_TENSORS: {
        "codes": "weight_packed", "scale": "weight_scale", "global": "weight_global_scale", "input": "input_global_scale",
    },
}


def global_multiplier(loaded: torch.Tensor, layout: NvFp4Layout, what: str) -> float:
    """A checkpoint's per-tensor global scale as the multiplier the dequantisation applies."""
    t = materialize(loaded).float().reshape(-1)
    if t.numel() != 1:  # the format has one per tensor; a vector would be a layout this does not read
        raise ValueError(f"{what}: a global scale of {t.numel()} values (NVFP4 stores one per tensor)")
    v = float(t[0])
    if not v > 0:
        raise ValueError(f"{what}: global scale {v} is not positive")
    return 1.0 / v if layout is NvFp4Layout.COMPRESSED_TENSORS else v


def check_nvfp4_dims(what: str, input_size: int) -> None:
    if input_size % GROUP:
        raise ValueError(f"{what}: NVFP4 needs the input size per rank ({input_size}) to be a multiple of {GROUP}")


_logged: set[NvFp4Kernel] = set()


def log_kernel(kernel: NvFp4Kernel, device: torch.device) -> None:
    """Once per kernel a process takes (a model has hundreds of linears)."""
    if kernel not in _logged:
        _logged.add(kernel)
        log.info("NVFP4 linears on %s: %s", device, kernel.value)


@register
class NvFp4LinearMethod(LinearMethod):
    kind = QuantMethod.NVFP4

    def create_weights(self, layer: QuantLayer, input_size: int, output_size: int, dtype: torch.dtype) -> None:
        check_nvfp4_dims(type(layer).__name__, input_size)
        self.dtype = dtype
        self.names = NAMES[self.config.nvfp4_layout]
        n = self.names
        setattr(layer, n["codes"], quant_param(torch.empty(output_size, input_size // 2, dtype=torch.uint8), Sharding(0, 1, 1, 2)))
        scale = torch.empty(output_size, input_size // GROUP, dtype=torch.float8_e4m3fn)
        setattr(layer, n["scale"], quant_param(scale, Sharding(0, 1, 1, GROUP)))
        # per output row (see the module's docstring); filled from each shard's scalar by `load`
        setattr(layer, n["global"], quant_param(torch.zeros(output_size), Sharding(0, None)))
        if self.config.input_scales:
            setattr(layer, n["input"], quant_param(torch.zeros(1), Sharding(None, None)))

    def load(self, layer: QuantLayer, param: nn.Parameter, loaded: Any, shard_id: str | int | None, name: str) -> None:
        n, layout = self.names, self.config.nvfp4_layout
        if param is getattr(layer, n["global"]):
            dst_off, _, size = layer.out_range(shard_id)
            param.data.narrow(0, dst_off, size).fill_(global_multiplier(loaded, layout, name))
            return
        if param is getattr(layer, n["input"], None):
            param.data.fill_(max(float(param.data[0]), global_multiplier(loaded, layout, name)))
            return
        super().load(layer, param, loaded, shard_id, name)

    def dequantized_weight(self, layer: QuantLayer) -> torch.Tensor:
        n = self.names
        return dequantize_nvfp4(getattr(layer, n["codes"]).data, getattr(layer, n["scale"]).data, getattr(layer, n["global"]).data)

    def process_weights_after_loading(self, layer: QuantLayer) -> None:
        n = self.names
        codes: nn.Parameter = getattr(layer, n["codes"])
        device = codes.device
        capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        fp4 = self.config.input_scales and flashinfer_fp4_available()
        default = nvfp4_kernel_for(device.type, capability, fp4)
        self.kernel = self.config.kernel if isinstance(self.config.kernel, NvFp4Kernel) else default
        log_kernel(self.kernel, device)
        if self.kernel is NvFp4Kernel.DENSE:
            w = self.dequantized_weight(layer).to(self.dtype)
            for role in ("codes", "scale", "global", "input"):
                if hasattr(layer, n[role]):
                    delattr(layer, n[role])
            layer.weight = quant_param(w, Sharding(None, None))
            return
        # one canonical set of names for the kernels, whichever layout was read
        canon = {"codes": "weight", "scale": "weight_scale", "global": "weight_scale_2", "input": "input_scale"}
        for role, ours in canon.items():
            if n[role] != ours and hasattr(layer, n[role]):
                p = getattr(layer, n[role])
                delattr(layer, n[role])
                setattr(layer, ours, p)
        if self.kernel is NvFp4Kernel.FP4_GEMM:
            from agentbox.kernels.nvfp4 import prepare_fp4_gemm

            layer.fp4_weight, layer.fp4_weight_scale = prepare_fp4_gemm(layer.weight.data, layer.weight_scale.data)

    def apply(self, layer: QuantLayer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.kernel is NvFp4Kernel.DENSE:
            return F.linear(x, layer.weight, bias)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.kernel is NvFp4Kernel.FP4_GEMM:
            from agentbox.kernels.nvfp4 import fp4_gemm

            out = fp4_gemm(x2, layer.fp4_weight, layer.fp4_weight_scale, layer.weight_scale_2, layer.input_scale, layer.output_size)
        else:
            from agentbox.kernels.nvfp4 import nvfp4_w4a16_matmul

            out = nvfp4_w4a16_matmul(x2, layer.weight, layer.weight_scale, layer.weight_scale_2)
        out = out.reshape(*shape[:-1], -1)
        return out + bias if bias is not None else out

