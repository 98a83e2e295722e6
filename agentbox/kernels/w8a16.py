"""w8a16 block FP8: x [M, K] (fp16 / bf16 / fp32) times an fp8 e4m3 weight [N, K] with one scale per
(bo x bi) block, dequantised tile by tile inside the GEMM (weight-only: for GPUs without FP8 matmul, and
the reference the w8a8 path would be measured against).

The kernel reads the fp8 bytes as uint8 and decodes e4m3 with the shared tile decoder of
kernels/_quant_triton.py (in arithmetic, or by Triton's own conversion on sm_89+). The twin,
`w8a16_block_matmul_ref`, defines it (through kernels/dequant.py).
"""

from __future__ import annotations

import torch

from agentbox.kernels._quant_triton import WeightFormat, check_runnable, dequant_gemm, native_fp8
from agentbox.kernels.dequant import dequant_fp8_block


def w8a16_block_matmul_ref(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    return (x.float() @ dequant_fp8_block(weight, scale_inv, block).t()).to(x.dtype)


def w8a16_block_matmul(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
    fmt: WeightFormat | None = None,
) -> torch.Tensor:
    """`fmt` (FP8 or FP8_NATIVE) picks the e4m3 decode; by default the device's best."""
    check_runnable(x, weight)
    n = weight.shape[0]
    if block[1] % 32:
        raise ValueError(f"w8a16: input block {block[1]} must be a multiple of 32")
    fmt = fmt or (WeightFormat.FP8_NATIVE if native_fp8(x.device) else WeightFormat.FP8)
    wbytes = weight.view(torch.uint8)  # [N, K]: K stride 1, N stride the row's
    return dequant_gemm(
        x, n, wbytes, scale_inv, fmt=fmt, k_group=block[1], n_group=block[0],  # a K tile never straddles a block
        w_strides=(wbytes.stride(1), wbytes.stride(0)), s_strides=(scale_inv.stride(1), scale_inv.stride(0)),
    )
