"""wbits: x [M, K] (fp16 / bf16 / fp32) times a 5-, 6- or 8-bit weight dequantised tile by tile inside the GEMM.

The weight is the k-bit form of kernels/dequant.py (GGUF Q5_0 / Q5_1 / Q8_0 / Q5_K / Q6_K reach it at load,
layers/quant/bits.py): the low nibbles in `qweight` [K / 8, N] (as w4a16's), the high bits in `qhigh`
[K (bits - 4) / 32, N], and per group of `group` rows of K a scale and an optional offset ([K / group, N]).
The twin, `wbits_matmul_ref`, defines it (through `dequant_bits`); the tile decoder is `load_bits_tile`.
Decode is memory-bound: the tile decode costs a few integer ops per weight against 5-8 bits read.
"""

from __future__ import annotations

import torch
from agentbox.kernels._quant_triton import HAS_TRITON, check_runnable, load_bits_tile, tl, triton
from agentbox.kernels.dequant import BITS, dequant_bits

BLOCK_K = 16  # divides both GGUF groups (Q6_K's is 16): a K tile never straddles a group


def wbits_matmul_ref(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qhigh: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor | None,
    group: int,
    bits: int,
) -> torch.Tensor:
    return (x.float() @ dequant_bits(qweight, qhigh, scale, offset, group, bits)).to(x.dtype)


if HAS_TRITON:

    @triton.jit
    def _wbits_kernel(
        x_ptr, q_ptr, h_ptr, s_ptr, o_ptr, out_ptr, M, N, K, group,
        sxm, sxk, sqk, sqn, shk, shn, ssk, ssn, sok, son,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        BITS: tl.constexpr, HAS_OFFSET: tl.constexpr,
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
            w = load_bits_tile(q_ptr, h_ptr, s_ptr, o_ptr, k0, rk, rn, kmask, rn < N,
                               sqk, sqn, shk, shn, ssk, ssn, sok, son, group, BITS, HAS_OFFSET)
            acc += tl.dot(x, w.to(x.dtype), input_precision="ieee")  # fp32: no TF32, as torch does
        out = acc.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + rm[:, None] * N + rn[None, :], out, mask=(rm < M)[:, None] & (rn < N)[None, :])


def wbits_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qhigh: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor | None,
    group: int,
    bits: int,
) -> torch.Tensor:
    check_runnable(x, qweight)
    m, k = x.shape
    n = qweight.shape[1]
    if bits not in BITS or group % BLOCK_K or k % group or k % 32 or qweight.shape[0] * 8 != k:
        raise ValueError(
            f"wbits: bits {bits} (one of {BITS}), K={k} and group {group} (multiples of {BLOCK_K}, K of 32) "
            f"must match qweight {tuple(qweight.shape)}"
        )
    if qhigh.shape[0] * 32 != k * (bits - 4):
        raise ValueError(f"wbits: qhigh {tuple(qhigh.shape)} does not hold {bits - 4} high bits of K={k} rows")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    o = scale if offset is None else offset  # not read without an offset
    grid = (triton.cdiv(m, 16), triton.cdiv(n, 64))
    _wbits_kernel[grid](
        x, qweight, qhigh, scale, o, out, m, n, k, group,
        x.stride(0), x.stride(1), qweight.stride(0), qweight.stride(1), qhigh.stride(0), qhigh.stride(1),
        scale.stride(0), scale.stride(1), o.stride(0), o.stride(1),
        BLOCK_M=16, BLOCK_N=64, BLOCK_K=BLOCK_K, BITS=bits, HAS_OFFSET=offset is not None,
    )
    return out
