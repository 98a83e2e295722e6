"""A vocabulary table kept in GGUF's blocks' codes: the embedding and the (tied) LM head.

On CPU (`QuantRows`): Q8_0 rows become int8 codes [V, H/32, 32] with one fp32 scale per 32 (exact: the
file's fp16 scale); Q4_0 / Q4_1 / Q4_K rows become the 4-bit form of kernels/cpu_gemv (`int4_groups` gives
the exact scale and offset per 32). Lookups dequantise the rows asked for; the head multiplies with the
kernel, or, for many rows at once (prompt logprobs), dequantises the table once and runs one sgemm.

Where the linear layers run Triton (GPU; `PackedRows`): the table takes the linear layers' own GPU form
(int4's for Q4_*, the k-bit form for Q5_* / Q6_K / Q8_0, K-major), so the head is their dequant-GEMM over
the whole vocabulary and a lookup gathers the asked rows' columns and dequantises them (kernels/dequant.py).
Qwen2.5-32B's two tables are 3.1 GB in bf16, 1.2 GB so.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from agentbox.layers.quant.gguf import INT4_TYPES, GGUFBlocks, int4_groups

MAX_KERNEL_ROWS = 32  # as int4.CPU_SIMD_MAX_ROWS: beyond it one dequantise + sgemm is faster


@dataclass
class QuantRows:
    codes: torch.Tensor  # Q8: [V, H/32, 32] int8; Q4: [V, H/32, 16] uint8
    scale: torch.Tensor  # [V, H/32]: fp32 (Q8, and Q4 where fp16 is not exact), fp16
    offset: torch.Tensor  # [V, H/32] like scale (Q4), empty (Q8)

    @property
    def is_q8(self) -> bool:
        return self.codes.dtype == torch.int8

    def dense(self, ids: torch.Tensor | None = None) -> torch.Tensor:
        from agentbox.kernels import cpu_gemv

        if self.is_q8:
            if ids is not None:
                return cpu_gemv.q8_rows(self.codes, self.scale, ids)
            return (self.codes.float() * self.scale.unsqueeze(-1)).flatten(1)
        codes, scale, offset = (self.codes, self.scale, self.offset) if ids is None else (
            self.codes[ids.reshape(-1)], self.scale[ids.reshape(-1)], self.offset[ids.reshape(-1)]
        )
        out = cpu_gemv.q4_dequant(codes.contiguous(), scale.contiguous(), offset.contiguous())
        return out if ids is None else out.reshape(*ids.shape, -1)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.dense(ids)

    def matmul(self, hidden: torch.Tensor) -> torch.Tensor:
        from agentbox.kernels import cpu_gemv

        shape = hidden.shape
        x = hidden.reshape(-1, shape[-1])
        if x.shape[0] > MAX_KERNEL_ROWS:
            out = F.linear(cpu_gemv.round_activations(x), self.dense())  # the kernel's numbers, one sgemm
        elif self.is_q8:
            out = cpu_gemv.q8_matmul(x, self.codes, self.scale)
        else:
            out = cpu_gemv.q4_matmul(x, self.codes, self.scale, self.offset)
        return out.to(hidden.dtype).reshape(*shape[:-1], -1)


class PackedRows(torch.nn.Module):
    """A table in a linear layer's Triton form (installed on this module by `gguf.install_rows`)."""

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        from agentbox.kernels.dequant import dequant_bits, dequant_int4

        idx = ids.reshape(-1)
        if hasattr(self, "bits_kernel"):
            offset = None if self.offset_t is None else self.offset_t[:, idx]
            w = dequant_bits(self.qweight_t[:, idx], self.qhigh_t[:, idx], self.scale_t[:, idx], offset,
                             self.bits_group, self.bits)
        else:
            w = dequant_int4(self.qweight_t[:, idx], self.scale_t[:, idx], self.offset_t[:, idx], self.int4_group)
        return w.t().to(self.scale_t.dtype).reshape(*ids.shape, -1)

    def matmul(self, hidden: torch.Tensor) -> torch.Tensor:
        from agentbox.layers.quant.gguf import apply_form

        return apply_form(self, hidden, None)


def quant_rows(
    blocks: GGUFBlocks, start: int, rows: int, padded: int, device: torch.device, dtype: torch.dtype = torch.float32
) -> QuantRows | PackedRows | None:
    """This rank's rows [start, start + rows) of a GGUF table, padded with zero rows to `padded`; None when
    the table is not kept quantised here (no kernel, or another type) and must be dequantised."""
    from agentbox.layers.quant import int4

    hidden = blocks.shape[1]
    if hidden % 32 == 0 and int4.default_kernel(device) is int4.Int4Kernel.TRITON:
        from agentbox.layers.quant.gguf import install_rows

        return install_rows(PackedRows(), blocks.narrow((start, rows), None), padded, dtype, device)
    if device.type != "cpu" or hidden % 32 or int4.default_cpu_kernel() is not int4.Int4Kernel.CPU_SIMD:
        return None  # the same switch as the linear layers' (tests pin the dense path for exactness)
    from agentbox.kernels import cpu_gemv

    part = blocks.narrow((start, rows), None)
    if part.qtype is GGMLQuantizationType.Q8_0:
        raw = np.ascontiguousarray(part.data).reshape(rows, hidden // 32, 34)
        scale = torch.from_numpy(raw[..., :2].copy().view(np.float16).astype(np.float32)[..., 0])
        codes = torch.from_numpy(raw[..., 2:].copy().view(np.int8))
        offset = torch.empty(0)
    elif part.qtype in INT4_TYPES:
        q, scale, offset = int4_groups(part)
        codes = cpu_gemv.pack_q4(q)
        scale, offset = cpu_gemv.exact_half(scale, offset)
    else:
        return None
    pad = padded - rows
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad, *codes.shape[1:])])
        scale = torch.cat([scale, scale.new_zeros(pad, scale.shape[1])])
        if offset.numel():
            offset = torch.cat([offset, offset.new_zeros(pad, offset.shape[1])])
    return QuantRows(codes.contiguous(), scale.contiguous(), offset.contiguous())
