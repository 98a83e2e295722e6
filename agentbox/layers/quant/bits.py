"""2-, 3-, 5-, 6- and 8-bit weights in one form (GGUF Q5_0 / Q5_1 / Q8_0 / Q5_K / Q6_K, and on CPU Q2_K / Q3_K;
4-bit weights take int4.py's):
codes q in [0, 2^bits) per element, and per (row, group of 16 or 32 input columns) a scale and optionally an
offset, so that w = q * scale + offset, or w = (q - 2^(bits-1)) * scale for the symmetric types. The GGUF
loader converts the file's blocks into this (`gguf.bits_groups`, exact); the kernels take it from here.

Resident bytes per weight on GPU (16-bit scales): bits / 8 + 2 (or 4 with an offset) / group, against the
file's Q5_0 0.6875 (same), Q5_1 0.75 (same), Q8_0 1.0625 (same), Q5_K 0.6875 (ours 0.75: fp16 per 32 where the
file packs 6-bit scales per 32 under one fp16 per 256), Q6_K 0.8203 (ours 0.875: fp16 per 16 where the file
has int8 per 16) - within 10 % of the file for every type. On CPU (kernels/cpu_bits.c) per 256 columns:
Q5_0 / Q5_1 / Q8_0 exactly the file's bytes (fp16 scales), Q5_K 5.75 bits (file 5.5), Q6_K 6.625 (6.5625),
Q2_K 2.75 (2.625), Q3_K 3.625 (3.4375). Q2_K / Q3_K have no GPU kernel here: the GGUF loader keeps them in this
form only for CPU_SIMD (and dequantises them elsewhere).
"""

from __future__ import annotations

from enum import Enum

import torch


class BitsKernel(Enum):
    DENSE = "dense"  # dequantised once at load to the compute dtype
    TRITON = "triton"  # kernels/wbits.py: low nibbles and high bits packed along K, scale/offset [K/g, N]
    CPU_SIMD = "cpu-simd"  # kernels/cpu_bits.c: one byte stream per row (scales, high bits, nibbles)


# Rows of x above which a CPU_SIMD layer dequantises once and runs one sgemm. It was 8 (1536 x 576 Q5_0, AVX2:
# 16 rows 841 us in the kernel vs 718 dequantised); since the kernel takes many rows in slices that stay in the L2
# cache (cpu_bits.c, ab_bits_matmul), a Qwen3-30B-A3B expert's prompt rows cost 0.34-0.80 of dequantise + sgemm at
# 128 and 512 rows (Q8_0 and Q6_K, 1536 x 2048 and 2048 x 768, one thread of the shared AVX-512 VNNI EPYC), so
# prefill takes the kernel too, as the 4-bit one does (int4.CPU_SIMD_MAX_ROWS).
CPU_SIMD_MAX_ROWS = 4096


def default_kernel(device: torch.device) -> BitsKernel:
    if device.type != "cpu":
        return BitsKernel.TRITON
    from agentbox.layers.quant import int4

    # the 4-bit layers' switch: int4.cpu_kernel(DENSE) (the exact tests, --exact-cpu) keeps these dense too
    return BitsKernel.CPU_SIMD if int4.default_cpu_kernel() is int4.Int4Kernel.CPU_SIMD else BitsKernel.DENSE


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
    if kernel is BitsKernel.CPU_SIMD and dtype is not torch.float32:
        kernel = BitsKernel.DENSE  # the kernel's activations are fp32
    if kernel is BitsKernel.CPU_SIMD:
        from agentbox.kernels.cpu_bits import pack_bits_cpu

        layer.bits_cpu = pack_bits_cpu(q, bits, scale, offset)
        layer.weight = quant_param(layer.bits_cpu.data, none)  # the same storage: resident bytes count it
    elif kernel is BitsKernel.DENSE:
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
    shape = x.shape
    if layer.bits_kernel is BitsKernel.CPU_SIMD:
        from agentbox.kernels import cpu_bits, cpu_gemv

        rows = x.reshape(-1, shape[-1])
        if rows.shape[0] <= CPU_SIMD_MAX_ROWS:
            out = cpu_bits.bits_matmul(rows, layer.bits_cpu)
        else:  # the kernel's numbers: its int8-rounded activations times the dequantised weight
            out = torch.nn.functional.linear(cpu_gemv.round_activations(rows), cpu_bits.bits_dequant(layer.bits_cpu))
        out = out.reshape(*shape[:-1], -1)
        return out + bias if bias is not None else out
    from agentbox.kernels.wbits import wbits_matmul

    out = wbits_matmul(
        x.reshape(-1, shape[-1]), layer.qweight_t, layer.qhigh_t, layer.scale_t, layer.offset_t, layer.bits_group, layer.bits
    ).reshape(*shape[:-1], -1)
    return out + bias if bias is not None else out
