"""w4a16: x [M, K] (fp16 / bf16 / fp32) times a 4-bit weight dequantised tile by tile inside the GEMM.

The weight is the canonical int4 form of layers/quant/int4.py, transposed for the kernel: codes packed
eight rows of K per int32 word (`qweight` [K / 8, N], row k at bits 4 * (k % 8)), and per group of
`group` rows a scale and an offset (`scale`, `offset` [K / group, N]): w[k, n] = q * scale + offset.
AWQ, GPTQ and GGUF Q4_0 / Q4_1 / Q4_K all reach this form at load. The twin, `w4a16_matmul_ref`, defines it
(through kernels/dequant.py); the tile decoder is the shared one of kernels/_quant_triton.py.
"""

from __future__ import annotations

import torch
from agentbox.kernels._quant_triton import (
    HAS_TRITON,
    WeightFormat,
    check_runnable,
    load_weight_tile,
    tl,
    triton,
)
from agentbox.kernels.dequant import dequant_int4


def w4a16_matmul_ref(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group: int
) -> torch.Tensor:
    return (x.float() @ dequant_int4(qweight, scale, offset, group)).to(x.dtype)


if HAS_TRITON:

    @triton.jit
    def _w4a16_kernel(
        x_ptr, q_ptr, s_ptr, o_ptr, out_ptr, M, N, K, group,
        sxm, sxk, sqk, sqn, ssg, ssn, som, son,
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
            w = load_weight_tile(q_ptr, s_ptr, o_ptr, k0, rk, rn, kmask, rn < N,
                                 sqk, sqn, ssg, ssn, som, son, group, 1, FORMAT)
            acc += tl.dot(x, w.to(x.dtype), input_precision="ieee")  # fp32: no TF32, as torch does
        out = acc.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + rm[:, None] * N + rn[None, :], out, mask=(rm < M)[:, None] & (rn < N)[None, :])


def w4a16_matmul(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group: int
) -> torch.Tensor:
    check_runnable(x, qweight)
    m, k = x.shape
    n = qweight.shape[1]
    if group % 32 or k % group or qweight.shape[0] * 8 != k:
        raise ValueError(f"w4a16: K={k} and group {group} must be multiples of 32 matching qweight {tuple(qweight.shape)}")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, 16), triton.cdiv(n, 64))
    _w4a16_kernel[grid](
        x, qweight, scale, offset, out, m, n, k, group,
        x.stride(0), x.stride(1), qweight.stride(0), qweight.stride(1),
        scale.stride(0), scale.stride(1), offset.stride(0), offset.stride(1),
        BLOCK_M=16, BLOCK_N=64, BLOCK_K=32, FORMAT=WeightFormat.INT4.value,  # a K tile never straddles a group
    )
    return out
