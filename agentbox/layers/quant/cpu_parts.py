"""A linear layer as the CPU SIMD kernels hold it, for callers that run them from C (engine/exec/cpu_decode.py's fused
layer, kernels/cpu_moe.c's ab_linear and ab_moe): its runs of output rows, each cpu_gemv's 4-bit tiles or cpu_bits'
k-bit rows, and the C structs that carry them (kernels/cpu_gemv.h's ab_part_t and ab_moe_t).
"""

from __future__ import annotations

import ctypes
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


_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class PartStruct(ctypes.Structure):  # cpu_gemv.h's ab_part_t
    _fields_ = [("w", _ptr), ("so", _ptr), ("n", _i64), ("k", _i64), ("group", _i64), ("bits", _i64), ("half", _i64),
                ("form", _i64), ("off", _i64)]


class MoeStruct(ctypes.Structure):  # cpu_gemv.h's ab_moe_t
    _fields_ = [("router", _ptr), ("experts", _i64), ("top_k", _i64), ("renorm", _i64), ("inter", _i64),
                ("w13", PartStruct), ("w2", PartStruct), ("w13_stride", _i64), ("w13_so_stride", _i64),
                ("w2_stride", _i64), ("w2_so_stride", _i64)]


def part_struct(p: CpuPart) -> PartStruct:
    return PartStruct(p.w.data_ptr(), None if p.so is None else p.so.data_ptr(), p.n, p.k, p.group, p.bits,
                      int(p.half), p.form, int(p.off))


def _stride(t: torch.Tensor | None) -> int:
    """Bytes from one expert's tensor to the next's."""
    return 0 if t is None else t[0].numel() * t.element_size()


def moe_struct(w13: CpuPart, w2: CpuPart, experts: int, top_k: int, renormalize: bool, inter: int,
               router: torch.Tensor | None) -> MoeStruct:
    """Routed experts whose [E, ...] projections are w13 and w2 (each part's tensors the first expert's view of all of
    them); `router` the dense fp32 [E, H] gate where C routes (ab_moe), None where the caller does (ab_moe_routed)."""
    return MoeStruct(None if router is None else router.data_ptr(), experts, top_k, int(renormalize), inter,
                     part_struct(w13), part_struct(w2), _stride(w13.w), _stride(w13.so), _stride(w2.w), _stride(w2.so))
