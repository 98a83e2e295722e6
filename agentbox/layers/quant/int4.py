"""4-bit weights in one canonical form, whatever the checkpoint's layout (GGUF Q4_0/Q4_1/Q4_K, AWQ, GPTQ):
codes q in 0..15 per element, and per (row, group of `group` input columns) a scale and an offset, so that
w = q * scale + offset. Each format's loader converts its bytes into this; the kernels take it from here.

CPU kernels, measured on this machine (AMD EPYC, AVX2, no AVX512; torch 2.13, one thread, SmolLM2 shapes,
[1, 576] x [576, 1536]): dense fp32 matmul of the dequantised weight 275-290 us, torch's
`_weight_int4pack_mm_for_cpu` 191 us with bf16 activations (compute-bound without AVX512-BF16: it buys
memory, not speed), our AVX2 kernel (kernels/cpu_gemv.c: int8 activations per block of 32, as llama.cpp
does) about 50 us for the 960 x 576 qkv and 120 us for the 3072 x 576 gate_up (7-9 GB/s of weights). So
the default CPU kernel is ours where it builds (`CPU_SIMD`), torch's int4 where the CPU has AVX512-BF16 and
ours does not build, and the dequantised weight otherwise.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from enum import Enum
from pathlib import Path

import torch


class Int4Kernel(Enum):
    DENSE = "dense"  # dequantised once at load to the compute dtype
    INT4_CPU = "int4-cpu"  # torch's tinygemm CPU kernel: packed nibbles + bf16 scale/zero per group
    TRITON = "triton"  # kernels/w4a16.py: codes packed along K in int32, scale/offset in the compute dtype
    TRITON_K = "triton-k"  # kernels/w4a16.py w4k_matmul: the same codes under GGUF Q4_K's own two-level scales
    CPU_SIMD = "cpu-simd"  # kernels/cpu_gemv.c: 16 bytes of nibbles + a scale and offset per 32 columns, rows tiled by 4


# Rows of x above which a CPU_SIMD layer dequantises once and runs one sgemm instead. The kernel's int8 dot
# products do 32 multiply-adds an instruction to the sgemm's 8, and it reads the weight once per 8 rows from
# the cache: 1536 x 576 at one thread (AMD EPYC, AVX2) took 1.2 / 2.4 / 4.5 / 20.9 ms for 64 / 128 / 256 / 512
# rows against 11.6 / 13.8 / 21.8 / 46.1 ms dequantised. So only a step beyond the engine's token budget.
CPU_SIMD_MAX_ROWS = 4096


_override: Int4Kernel | None = None


@contextlib.contextmanager
def cpu_kernel(kernel: Int4Kernel) -> Iterator[None]:
    """Models loaded inside use `kernel` on CPU (the GGUF benchmark times each choice on one machine)."""
    global _override
    previous, _override = _override, kernel
    try:
        yield
    finally:
        _override = previous


@functools.cache
def cpu_has_avx512_bf16() -> bool:
    try:
        return "avx512_bf16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def default_cpu_kernel() -> Int4Kernel:
    if _override is not None:
        return _override
    from agentbox.kernels import cpu_gemv

    if cpu_gemv.available():
        return Int4Kernel.CPU_SIMD
    return Int4Kernel.INT4_CPU if cpu_has_avx512_bf16() else Int4Kernel.DENSE


def dequantize(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """The reference: q [N, K] codes, scale/offset [N, K // g] -> w [N, K] fp32."""
    n, k = q.shape
    g = k // scale.shape[1]
    w = q.reshape(n, k // g, g).float() * scale.float().unsqueeze(-1) + offset.float().unsqueeze(-1)
    return w.reshape(n, k)


def pack_int4_cpu(
    q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed [N, K/2] uint8, scales_and_zeros [K/g, N, 2] bf16) for `_weight_int4pack_mm_for_cpu`,
    whose dequantisation is (q - 8) * scale + zero: zero = offset + 8 * scale."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
    zero = offset.float() + 8 * scale.float()
    sz = torch.stack([scale.float(), zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return packed, sz


def int4_cpu_mm(x: torch.Tensor, packed: torch.Tensor, group: int, sz: torch.Tensor) -> torch.Tensor:
    shape = x.shape
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, shape[-1]).to(torch.bfloat16), packed, group, sz)
    return out.to(x.dtype).reshape(*shape[:-1], -1)


def pack_rows_int32(q: torch.Tensor) -> torch.Tensor:
    """[K, N] codes -> [K / 8, N] int32, eight consecutive rows per word, row k at bits 4 * (k % 8)
    (GPTQ's qweight order; what the Triton w4a16 kernel reads)."""
    k, n = q.shape
    q = q.to(torch.int32).reshape(k // 8, 8, n)
    out = torch.zeros(k // 8, n, dtype=torch.int32)
    for i in range(8):
        out |= q[:, i] << (4 * i)
    return out


def unpack_rows_int32(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_rows_int32: [K / 8, N] int32 -> [K, N] uint8 codes."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    q = (packed.unsqueeze(1) >> shifts.view(1, 8, 1)) & 0xF
    return q.reshape(-1, packed.shape[1]).to(torch.uint8)


def install(
    layer: torch.nn.Module,
    q: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor,
    kernel: Int4Kernel,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """Replace a layer's checkpoint parameters by the form `kernel` runs (q [N, K], scale/offset [N, K/g]).
    Parameters (not buffers), so resident_weight_bytes counts them."""
    from agentbox.layers.quant.base import Sharding, quant_param

    none = Sharding(None, None)
    layer.int4_group = group = q.shape[1] // scale.shape[1]
    if kernel is Int4Kernel.CPU_SIMD and (group % 32 or dtype is not torch.float32):
        kernel = Int4Kernel.DENSE  # the kernel's blocks are 32 columns and its activations fp32
    if kernel is Int4Kernel.CPU_SIMD:
        from agentbox.kernels.cpu_gemv import pack_q4

        codes, so = pack_q4(q, scale, offset)
        from agentbox.kernels.huge_pages import huge

        layer.weight, layer.scale = quant_param(huge(codes), none), quant_param(huge(so), none)
        layer.q4_rows = q.shape[0]
    elif kernel is Int4Kernel.DENSE:
        layer.weight = quant_param(dequantize(q, scale, offset).to(device=device, dtype=dtype), none)
    elif kernel is Int4Kernel.INT4_CPU:
        packed, sz = pack_int4_cpu(q, scale, offset)
        layer.weight = quant_param(packed, none)
        layer.scales_zeros = quant_param(sz, none)
    else:  # TRITON: codes packed along K, scale/offset [K/g, N] in the compute dtype
        layer.qweight_t = quant_param(pack_rows_int32(q.t().contiguous()).to(device), none)
        layer.scale_t = quant_param(scale.t().contiguous().to(device=device, dtype=dtype), none)
        layer.offset_t = quant_param(offset.t().contiguous().to(device=device, dtype=dtype), none)
    layer.int4_kernel = kernel


def install_k(
    layer: torch.nn.Module, q: torch.Tensor, sc: torch.Tensor, mn: torch.Tensor, dd: torch.Tensor, device: torch.device
) -> None:
    """GGUF Q4_K at its file's bytes for the Triton kernel: q [N, K] codes, sc / mn [N, K/32] its 6-bit scales and
    mins, dd [N, K/256, 2] fp16 its d and dmin (w = q * d * sc - dmin * mn)."""
    from agentbox.layers.quant.base import Sharding, quant_param

    none = Sharding(None, None)
    layer.int4_group = 32
    layer.qweight_t = quant_param(pack_rows_int32(q.t().contiguous()).to(device), none)
    layer.sc_t = quant_param(sc.t().contiguous().to(device), none)
    layer.mn_t = quant_param(mn.t().contiguous().to(device), none)
    layer.dd_t = quant_param(dd.transpose(0, 1).contiguous().to(device), none)
    layer.int4_kernel = Int4Kernel.TRITON_K


def apply(layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    kernel: Int4Kernel = layer.int4_kernel
    if kernel is Int4Kernel.DENSE:
        return torch.nn.functional.linear(x, layer.weight, bias)
    if kernel is Int4Kernel.CPU_SIMD:
        from agentbox.kernels import cpu_gemv

        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        if rows.shape[0] <= CPU_SIMD_MAX_ROWS:
            out = cpu_gemv.q4_matmul(rows, layer.weight, layer.scale, layer.q4_rows)
        else:
            w = cpu_gemv.q4_dequant(layer.weight, layer.scale, layer.q4_rows)
            out = torch.nn.functional.linear(cpu_gemv.round_activations(rows), w)
        out = out.reshape(*shape[:-1], -1)
    elif kernel is Int4Kernel.INT4_CPU:
        out = int4_cpu_mm(x, layer.weight, layer.int4_group, layer.scales_zeros)
    elif kernel is Int4Kernel.TRITON_K:
        from agentbox.kernels.w4a16 import w4k_matmul

        shape = x.shape
        out = w4k_matmul(x.reshape(-1, shape[-1]), layer.qweight_t, layer.sc_t, layer.mn_t, layer.dd_t)
        out = out.reshape(*shape[:-1], -1)
    else:
        from agentbox.kernels.w4a16 import w4a16_matmul

        shape = x.shape
        out = w4a16_matmul(x.reshape(-1, shape[-1]), layer.qweight_t, layer.scale_t, layer.offset_t, layer.int4_group)
        out = out.reshape(*shape[:-1], -1)
    return out + bias if bias is not None else out


def default_kernel(device: torch.device) -> Int4Kernel:
    return default_cpu_kernel() if device.type == "cpu" else Int4Kernel.TRITON
