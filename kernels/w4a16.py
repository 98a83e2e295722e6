"""w4a16: x [M, K] (fp16 / bf16 / fp32) times a 4-bit weight dequantised tile by tile inside the GEMM.

The weight is the canonical int4 form of layers/quant/int4.py, transposed for the kernel: codes packed
eight rows of K per int32 word (`qweight` [K / 8, N], row k at bits 4 * (k % 8)), and per group of
`group` rows a scale and an offset (`scale`, `offset` [K / group, N]): w[k, n] = q * scale + offset.
AWQ, GPTQ and GGUF Q4_0 / Q4_1 / Q4_K all reach this form at load. The twin, `w4a16_matmul_ref`, defines it
(through kernels/dequant.py); the GEMM is the shared dense one of kernels/_quant_triton.py.
"""

from __future__ import annotations

import torch
from agentbox.kernels._quant_triton import WeightFormat, check_runnable, dequant_gemm
from agentbox.kernels.dequant import dequant_int4


def w4a16_matmul_ref(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group: int
) -> torch.Tensor:
    return (x.float() @ dequant_int4(qweight, scale, offset, group)).to(x.dtype)


def w4a16_matmul(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group: int
) -> torch.Tensor:
    check_runnable(x, qweight)
    m, k = x.shape
    n = qweight.shape[1]
    if group % 32 or k % group or qweight.shape[0] * 8 != k:
        raise ValueError(f"w4a16: K={k} and group {group} must be multiples of 32 matching qweight {tuple(qweight.shape)}")
    # BLOCK_K 32: a K tile never straddles a group
    return dequant_gemm(x, n, qweight, scale, fmt=WeightFormat.INT4, o=offset, k_group=group)
