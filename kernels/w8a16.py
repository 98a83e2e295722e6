"""w8a16 block FP8: x [M, K] (fp16 / bf16 / fp32) times an fp8 e4m3 weight [N, K] with one scale per
(bo x bi) block, dequantised tile by tile inside the GEMM (weight-only: for GPUs without FP8 matmul, and
the reference the w8a8 path would be measured against).

The kernel reads the fp8 bytes as uint8 and decodes e4m3 itself (sign, 4-bit exponent with bias 7,
3-bit mantissa, subnormals at exponent 0), so it runs under Triton's interpreter, which has no fp8 type.
The twin, `w8a16_block_matmul_ref`, defines it.
"""

from __future__ import annotations

import torch
from agentbox.kernels._quant_triton import HAS_TRITON, check_runnable, tl, triton


def w8a16_block_matmul_ref(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    n, k = weight.shape
    s = scale_inv.float().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return (x.float() @ (weight.float() * s).t()).to(x.dtype)


if HAS_TRITON:

    @triton.jit
    def _e4m3_to_f32(b):
        b = b.to(tl.int32)
        sign = tl.where((b & 0x80) != 0, -1.0, 1.0)
        e = (b >> 3) & 0xF
        m = (b & 0x7).to(tl.float32)
        normal = (1.0 + m / 8.0) * tl.exp2((e - 7).to(tl.float32))
        sub = (m / 8.0) * 0.015625  # 2^-6
        return sign * tl.where(e == 0, sub, normal)

    @triton.jit
    def _w8a16_kernel(
        x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, BO, BI,
        sxm, sxk, swn, swk, ssn, ssk,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
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
            wmask = kmask[:, None] & (rn < N)[None, :]
            wb = tl.load(w_ptr + rn[None, :] * swn + rk[:, None] * swk, mask=wmask, other=0)  # [BK, BN]
            s = tl.load(s_ptr + (rn // BO)[None, :] * ssn + (rk // BI)[:, None] * ssk, mask=wmask, other=0.0)
            w = _e4m3_to_f32(wb) * s
            acc += tl.dot(x, w.to(x.dtype))
        tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=(rm < M)[:, None] & (rn < N)[None, :])


def w8a16_block_matmul(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    check_runnable(x, weight)
    m, k = x.shape
    n = weight.shape[0]
    if block[1] % 32:
        raise ValueError(f"w8a16: input block {block[1]} must be a multiple of 32")
    wbytes = weight.view(torch.uint8)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, 16), triton.cdiv(n, 64))
    _w8a16_kernel[grid](
        x, wbytes, scale_inv, out, m, n, k, block[0], block[1],
        x.stride(0), x.stride(1), wbytes.stride(0), wbytes.stride(1), scale_inv.stride(0), scale_inv.stride(1),
        BLOCK_M=16, BLOCK_N=64, BLOCK_K=32,  # a K tile never straddles a scale block
    )
    return out
