"""A linear layer as the CPU SIMD kernels hold it, for callers that run them from C (engine/exec/cpu_decode.py's fused
layer, kernels/cpu_moe.c's ab_linear): its runs of output rows, each cpu_gemv's 4-bit tiles or cpu_bits' k-bit rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from agentbox.layers.quant.bits import BitsKernel
from agentbox.layers.quant.int4 import Int4Kernel


@dataclass(frozen=True)
class CpuPart:
    """One run of rows (kernels/cpu_gemv.h's ab_part_t): `w` (and `so`, the 4-bit scales and offsets) for an
    [n, k] weight; `form` and `off` are cpu_bits' scale form and offsets."""

    w: torch.Tensor
    so: torch.Tensor | None
    n: int
    k: int
    group: int
    bits: int
    half: bool = False
    form: int = 0
    off: bool = False


def part_of(module: nn.Module, k: int) -> CpuPart | None:
    """The run `module` holds (k input columns) if a CPU SIMD kernel runs it, else None."""
    if getattr(module, "int4_kernel", None) is Int4Kernel.CPU_SIMD and getattr(module, "act_perm", None) is None:
        so = module.scale
        return CpuPart(module.weight, so, module.q4_rows, k, module.int4_group, 4, half=so.dtype == torch.float16)
    if getattr(module, "bits_kernel", None) is BitsKernel.CPU_SIMD:
        w = module.bits_cpu
        return CpuPart(w.data, None, w.n, w.k, w.group, w.bits, form=int(w.form), off=w.has_offset)
    return None


def cpu_parts(layer: nn.Module) -> list[CpuPart] | None:
    """The layer's runs of rows in order, or None where any of them is not on a CPU SIMD kernel (a dense, GPU or
    act-order weight)."""
    parts = [part_of(m, layer.input_size) for m in layer.quant_method.row_runs(layer)]
    return None if any(p is None for p in parts) else parts  # type: ignore[return-value]
