"""5-, 6- and 8-bit weights in one form (GGUF Q5_0 / Q5_1 / Q8_0 / Q5_K / Q6_K; 4-bit weights take int4.py's):
codes q in [0, 2^bits) per element, and per (row, group of 16 or 32 input columns) a scale and optionally an
offset, so that w = q * scale + offset, or w = (q - 2^(bits-1)) * scale for the symmetric types. The GGUF
loader converts the file's blocks into this (`gguf.bits_groups`, exact); the kernels take it from here.

Resident bytes per weight on GPU (16-bit scales): bits / 8 + 2 (or 4 with an offset) / group, against the
file's Q5_0 0.6875 (same), Q5_1 0.75 (same), Q8_0 1.0625 (same), Q5_K 0.6875 (ours 0.75: fp16 per 32 where the
file packs 6-bit scales per 32 under one fp16 per 256), Q6_K 0.8203 (ours 0.875: fp16 per 16 where the file
has int8 per 16) - within 10 % of the file for every type.
"""

from __future__ import annotations

from enum import Enum

import torch


class BitsKernel(Enum):
    DENSE = "dense"  # dequantised once at load to the compute dtype
    TRITON = "triton"  # kernels/wbits.py: low nibbles and high bits packed along K, scale/offset [K/g, N]


def default_kernel(device: torch.device) -> BitsKernel:
    if device.type != "cpu":
        return BitsKernel.TRITON
    # The one place the CPU kernel plugs in (kernels/cpu_bits.py: pack_bits_cpu / bits_matmul): return its
    # kind here when `int4.default_cpu_kernel() is Int4Kernel.CPU_SIMD` (so int4.cpu_kernel(DENSE), which
    # exact tests use, keeps this dense too), install it in `install` and call it in `apply`. Until then
    # CPU layers hold the dequantised weight in the compute dtype.
    return BitsKernel.DENSE


def dequantize(q: torch.Tensor, bits: int, scale: torch.Tensor, offset: torch.Tensor | None) -> torch.Tensor:
    """The reference: q [N, K] codes, scale/offset [N, K // g] -> w [N, K] fp32 (gguf's own products)."""
    n, k = q.shape
    g = k // scale.shape[1]
    codes = q.reshape(n, k // g, g).float()
    if offset is None:
        w = (codes - (1 << (bits - 1))) * scale.float().unsqueeze(-1)
    else:
        w = codes * scale.float().unsqueeze(-1) + offset.float().unsqueeze(-1)
    return w.reshape(n, k)


def install(
    layer: torch.nn.Module,
    q: torch.Tensor,
    bits: int,
    scale: torch.Tensor,
    offset: torch.Tensor | None,
    kernel: BitsKernel,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """Replace a layer's checkpoint parameters by the form `kernel` runs (q [N, K], scale/offset [N, K/g]).
    Parameters (not buffers), so resident_weight_bytes counts them."""
    from agentbox.kernels.dequant import pack_bits
    from agentbox.layers.quant.base import Sharding, quant_param

    none = Sharding(None, None)
    layer.bits, layer.bits_group = bits, q.shape[1] // scale.shape[1]
    if kernel is BitsKernel.DENSE:
        layer.weight = quant_param(dequantize(q, bits, scale, offset).to(device=device, dtype=dtype), none)
    else:  # TRITON: K-major, as int4's TRITON form
        qweight, qhigh = pack_bits(q.t().contiguous(), bits)
        layer.qweight_t = quant_param(qweight.to(device), none)
        layer.qhigh_t = quant_param(qhigh.to(device), none)
        layer.scale_t = quant_param(scale.t().contiguous().to(device=device, dtype=dtype), none)
        layer.offset_t = None if offset is None else quant_param(offset.t().contiguous().to(device=device, dtype=dtype), none)
    layer.bits_kernel = kernel


def apply(layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if layer.bits_kernel is BitsKernel.DENSE:
        return torch.nn.functional.linear(x, layer.weight, bias)
    from agentbox.kernels.wbits import wbits_matmul

    shape = x.shape
    out = wbits_matmul(
        x.reshape(-1, shape[-1]), layer.qweight_t, layer.qhigh_t, layer.scale_t, layer.offset_t, layer.bits_group, layer.bits
    ).reshape(*shape[:-1], -1)
    return out + bias if bias is not None else out
