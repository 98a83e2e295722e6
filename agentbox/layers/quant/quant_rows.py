"""A vocabulary table kept in GGUF's blocks' codes: the embedding and the (tied) LM head.

On CPU (`QuantRows`): Q8_0 rows become kernels/cpu_gemv's Q8 form (int8 codes and the file's fp16 scale
per 32, exact); Q4_0 / Q4_1 / Q4_K rows its 4-bit form (`int4_groups` gives the exact scale and offset per
32). Lookups dequantise the rows asked for; the head multiplies with the kernel, or, for many rows at once
(prompt logprobs), dequantises the table once and runs one sgemm.

Where the linear layers run Triton (GPU; `PackedRows`): the table takes the linear layers' own GPU form
(int4's for Q4_*, the k-bit form for Q5_* / Q6_K / Q8_0, K-major), so the head is their dequant-GEMM over
the whole vocabulary and a lookup gathers the asked rows' columns and dequantises them (kernels/dequant.py).
Qwen2.5-32B's two tables are 3.1 GB in bf16, 1.2 GB so.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType

from agentbox.kernels.cpu_bits import BitsCPU
from agentbox.layers.quant.gguf import (
    BITS_TYPES,
    CPU_BITS_TYPES,
    INT4_TYPES,
    GGUFBlocks,
    bits_groups,
    int4_groups,
)

MAX_KERNEL_ROWS = 32  # as int4.CPU_SIMD_MAX_ROWS: beyond it one dequantise + sgemm is faster


@dataclass
class QuantRows:
    codes: torch.Tensor  # Q8: [V/4, H/32, 4, 32] int8; Q4: [V/4, H/32, 2, 4, 8] uint8 (cpu_gemv's tiles)
    scale: torch.Tensor  # Q8: [V/4, H/32, 4]; Q4: scales and offsets [V/4, H/32, 2, 4]; fp16 where exact
    n: int  # V (padded to the embedding's size)

    @property
    def is_q8(self) -> bool:
        return self.codes.dtype == torch.int8

    def dense(self, ids: torch.Tensor | None = None) -> torch.Tensor:
        from agentbox.kernels import cpu_gemv

        if self.is_q8:
            if ids is None:
                ids = torch.arange(self.n)
            return cpu_gemv.q8_rows(self.codes, self.scale, ids)
        if ids is None:
            return cpu_gemv.q4_dequant(self.codes, self.scale, self.n)
        return cpu_gemv.q4_rows(self.codes, self.scale, ids)  # the rows asked for, not their tiles

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.dense(ids)

    def matmul(self, hidden: torch.Tensor) -> torch.Tensor:
        from agentbox.kernels import cpu_dense, cpu_gemv

        shape = hidden.shape
        x = hidden.reshape(-1, shape[-1])
        if x.shape[0] > MAX_KERNEL_ROWS:
            out = cpu_dense.linear(cpu_gemv.round_activations(x), self.dense())  # the kernel's numbers, one sgemm
        elif self.is_q8:
            out = cpu_gemv.q8_matmul(x, self.codes, self.scale, self.n)
        else:
            out = cpu_gemv.q4_matmul(x, self.codes, self.scale, self.n)
        return out.to(hidden.dtype).reshape(*shape[:-1], -1)


@dataclass
class BitsRows:
    """A Q5_* / Q6_K / Q8_0 / Q2_K / Q3_K table on CPU in kernels/cpu_bits' form (Q4_K_M's Q6_K LM head): one
    byte stream per row, so a lookup dequantises only its rows."""

    w: BitsCPU

    @property
    def codes(self) -> torch.Tensor:  # the tensor the embedding registers as its parameter
        return self.w.data

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        from agentbox.kernels import cpu_bits

        return cpu_bits.bits_rows(self.w, ids)

    def matmul(self, hidden: torch.Tensor) -> torch.Tensor:
        from agentbox.kernels import cpu_bits, cpu_dense, cpu_gemv
        from agentbox.layers.quant.bits import CPU_SIMD_MAX_ROWS

        shape = hidden.shape
        x = hidden.reshape(-1, shape[-1])
        if x.shape[0] > CPU_SIMD_MAX_ROWS:
            out = cpu_dense.linear(cpu_gemv.round_activations(x), cpu_bits.bits_dequant(self.w))
        else:
            out = cpu_bits.bits_matmul(x, self.w)
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
) -> QuantRows | BitsRows | PackedRows | None:
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
        q8 = torch.from_numpy(raw[..., 2:].copy().view(np.int8))
        pad = padded - rows
        if pad:  # zero rows: the padded vocabulary's logits are 0, as the dense table's are
            q8, scale = torch.cat([q8, q8.new_zeros(pad, *q8.shape[1:])]), torch.cat([scale, scale.new_zeros(pad, scale.shape[1])])
        codes, packed = cpu_gemv.pack_q8(q8, scale)
    elif part.qtype in INT4_TYPES:
        q, scale, offset = int4_groups(part)
        pad = padded - rows
        if pad:
            q = torch.cat([q, q.new_zeros(pad, q.shape[1])])
            scale, offset = (torch.cat([t, t.new_zeros(pad, t.shape[1])]) for t in (scale, offset))
        codes, packed = cpu_gemv.pack_q4(q, scale, offset)
    elif part.qtype in BITS_TYPES | CPU_BITS_TYPES:  # Q4_K_M's LM head is Q6_K; llama.cpp's Q2_K embedding Q2_K
        from agentbox.kernels.cpu_bits import pack_bits_cpu

        g = bits_groups(part)
        pad = padded - rows
        q, scale, offset = g.codes, g.scale, g.offset
        if pad:  # zero rows: codes at the zero point, scale 0, offset 0 (logits 0, as a dense table's)
            q = torch.cat([q, q.new_zeros(pad, q.shape[1])])
            scale = torch.cat([scale, scale.new_zeros(pad, scale.shape[1])])
            offset = None if offset is None else torch.cat([offset, offset.new_zeros(pad, offset.shape[1])])
        return BitsRows(pack_bits_cpu(q, g.bits, scale, offset))
    else:
        return None
    from agentbox.kernels.huge_pages import huge

    return QuantRows(huge(codes), huge(packed), padded)  # the head streams them every decode step
