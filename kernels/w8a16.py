"""w8a16 block FP8: x [M, K] (fp16 / bf16 / fp32) times an fp8 e4m3 weight [N, K] with one scale per
(bo x bi) block, dequantised tile by tile inside the GEMM (weight-only: for GPUs without FP8 matmul, and
the reference the w8a8 path would be measured against).

The kernel reads the fp8 bytes as uint8 and decodes e4m3 with the shared tile decoder of
kernels/_quant_triton.py (in arithmetic, or by Triton's own conversion on sm_89+). The twin,
`w8a16_block_matmul_ref`, defines it (through kernels/dequant.py).
"""

from __future__ import annotations

import torch
from agentbox.kernels._quant_triton import (
    HAS_TRITON,
    WeightFormat,
    check_runnable,
    load_weight_tile,
    native_fp8,
    tl,
    triton,
)
from agentbox.kernels.dequant import dequant_fp8_block


def w8a16_block_matmul_ref(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    return (x.float() @ dequant_fp8_block(weight, scale_inv, block).t()).to(x.dtype)


if HAS_TRITON:

    @triton.jit
    def _w8a16_kernel(
        x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, BO, BI,
        sxm, sxk, swn, swk, ssn, ssk,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FORMAT: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            kmask = rk < K
            x = tl.load(x_ptr + rm[:, None] * sxm + rk[None, :] * sxk, mask=(rm < M)[:, None] & kmask[None, :], other=0.0)
            w = load_weight_tile(w_ptr, s_ptr, s_ptr, k0, rk, rn, kmask, rn < N,
                                 swk, swn, ssk, ssn, 0, 0, BI, BO, FORMAT)
            acc += tl.dot(x, w.to(x.dtype), input_precision="ieee")  # fp32: no TF32, as torch does
        tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=(rm < M)[:, None] & (rn < N)[None, :])


def w8a16_block_matmul(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
    fmt: WeightFormat | None = None,
) -> torch.Tensor:
    """`fmt` (FP8 or FP8_NATIVE) picks the e4m3 decode; by default the device's best."""
    check_runnable(x, weight)
    m, k = x.shape
    n = weight.shape[0]
    if block[1] % 32:
        raise ValueError(f"w8a16: input block {block[1]} must be a multiple of 32")
    fmt = fmt or (WeightFormat.FP8_NATIVE if native_fp8(x.device) else WeightFormat.FP8)
    wbytes = weight.view(torch.uint8)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, 16), triton.cdiv(n, 64))
    _w8a16_kernel[grid](
        x, wbytes, scale_inv, out, m, n, k, block[0], block[1],
        x.stride(0), x.stride(1), wbytes.stride(0), wbytes.stride(1), scale_inv.stride(0), scale_inv.stride(1),
        BLOCK_M=16, BLOCK_N=64, BLOCK_K=32, FORMAT=fmt.value,  # a K tile never straddles a scale block
    )
    return out
