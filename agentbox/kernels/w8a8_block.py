"""w8a8 block FP8: both operands in float8 e4m3 for GPUs with FP8 tensor cores (sm_89+: Ada, Hopper,
Blackwell), the DeepSeek-V3 / Qwen3-*-FP8 recipe.

- Activations are quantised per token and group of `block[1]` input columns (128 in every release): one
  float32 scale s_x[m, g] = max|x[m, group g]| / 448 (the e4m3 maximum), codes round(x / s_x) in e4m3.
- The weight is as stored: e4m3 [N, K] and one float32 scale per (block[0] x block[1]) block.
- Each K tile lies inside one group, so the GEMM adds tl.dot(x_q, w_q) (fp8 x fp8, fp32 accumulation)
  times s_x[:, g] x s_w[n // block[0], g] per tile.

Two kernels: `per_token_group_quant_fp8` and `w8a8_block_matmul` over its output. Their torch twins
(`*_ref`) define them. Triton's interpreter (3.9) runs fp8 loads, casts and dots, so both are checked on
CPU under TRITON_INTERPRET=1 like the other kernels here.
"""

from __future__ import annotations

import torch

from agentbox.kernels._quant_triton import HAS_TRITON, check_runnable, tl, triton

FP8_MAX = 448.0  # largest finite float8_e4m3fn
MIN_SCALE = 1e-10  # an all-zero group still gets a finite scale (its codes are then 0)


def per_token_group_quant_fp8_ref(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (codes [M, K] float8_e4m3fn, scales [M, ceil(K / group)] float32); a last partial group
    is scaled over the columns it has."""
    m, k = x.shape
    groups = -(-k // group)
    padded = torch.nn.functional.pad(x.float(), (0, groups * group - k)).reshape(m, groups, group)
    scale = (padded.abs().amax(dim=-1) / FP8_MAX).clamp(min=MIN_SCALE)
    q = (padded / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(m, groups * group)[:, :k].contiguous(), scale


def w8a8_block_matmul_ref(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """x [M, K] (any float dtype) times e4m3 weight [N, K] with per-block scales -> [M, N] in x's dtype, with
    x quantised per token and group of block[1] first (what the kernels compute)."""
    n, k = weight.shape
    q, sx = per_token_group_quant_fp8_ref(x, block[1])
    xd = q.float() * sx.repeat_interleave(block[1], 1)[:, :k]
    sw = scale_inv.float().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return (xd @ (weight.float() * sw).t()).to(x.dtype)


if HAS_TRITON:

    @triton.jit
    def _round_to_e4m3(v):
        """v (fp32, |v| <= 448) rounded to the nearest e4m3 value, ties to even, still in fp32: the cast that
        follows is then exact. Done by hand because Triton 3.9's interpreter casts fp32 -> e4m3 wrongly
        when rounding carries into the exponent (1.98 became 1.0, not 2.0); the GPU's cast rounds the same
        way as this."""
        bits = v.to(tl.int32, bitcast=True)
        keep = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000  # 3 of fp32's 23 mantissa bits, RNE
        normal = keep.to(tl.float32, bitcast=True)
        a = tl.abs(v)
        sub = (a + 16384.0) - 16384.0  # below 2^-6 e4m3 steps by 2^-9: fp32's own rounding at 2^14 does it
        return tl.where(a < 0.015625, tl.where(bits < 0, -sub, sub), normal)  # bits < 0: sign set, -0 too

    @triton.jit
    def _group_quant_kernel(
        x_ptr, q_ptr, s_ptr, K, groups, sxm, sqm, ssm,
        GROUP: tl.constexpr, FMAX: tl.constexpr, EPS: tl.constexpr,
    ):
        row = tl.program_id(0)
        g = tl.program_id(1)
        cols = g * GROUP + tl.arange(0, GROUP)
        mask = cols < K
        x = tl.load(x_ptr + row * sxm + cols, mask=mask, other=0.0).to(tl.float32)
        s = tl.maximum(tl.max(tl.abs(x), axis=0) / FMAX, EPS)
        q = _round_to_e4m3(tl.clamp(x / s, -FMAX, FMAX)).to(q_ptr.dtype.element_ty)
        tl.store(q_ptr + row * sqm + cols, q, mask=mask)
        tl.store(s_ptr + row * ssm + g, s)

    @triton.jit
    def _w8a8_kernel(
        q_ptr, sx_ptr, w_ptr, sw_ptr, out_ptr, M, N, K, BO, BI,
        sqm, sxm, swn, ssn, ssk,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mmask, nmask = rm < M, rn < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            kmask = rk < K
            a = tl.load(q_ptr + rm[:, None] * sqm + rk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
            b = tl.load(w_ptr + rn[None, :] * swn + rk[:, None], mask=kmask[:, None] & nmask[None, :], other=0.0)
            g = k0 // BI  # the whole tile lies in one group (BI % BLOCK_K == 0)
            sa = tl.load(sx_ptr + rm * sxm + g, mask=mmask, other=0.0)
            sb = tl.load(sw_ptr + (rn // BO) * ssn + g * ssk, mask=nmask, other=0.0)
            acc += tl.dot(a, b) * sa[:, None] * sb[None, :]
        tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=mmask[:, None] & nmask[None, :])


def per_token_group_quant_fp8(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    check_runnable(x)
    if group & (group - 1):
        raise ValueError(f"per-token-group quantisation: group {group} must be a power of two")
    m, k = x.shape
    x = x.contiguous()
    groups = triton.cdiv(k, group)
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, groups, dtype=torch.float32, device=x.device)
    if m:
        _group_quant_kernel[(m, groups)](
            x, q, s, k, groups, x.stride(0), q.stride(0), s.stride(0), GROUP=group, FMAX=FP8_MAX, EPS=MIN_SCALE,
        )
    return q, s


def w8a8_block_matmul(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    check_runnable(x, weight)
    if block[1] % 32:
        raise ValueError(f"w8a8: input block {block[1]} must be a multiple of 32")
    m, k = x.shape
    n = weight.shape[0]
    q, sx = per_token_group_quant_fp8(x, block[1])
    weight = weight.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_k = 64 if block[1] % 64 == 0 else 32  # a K tile never straddles a scale group
    grid = (triton.cdiv(m, 16), triton.cdiv(n, 64))
    _w8a8_kernel[grid](
        q, sx, weight, scale_inv, out, m, n, k, block[0], block[1],
        q.stride(0), sx.stride(0), weight.stride(0), scale_inv.stride(0), scale_inv.stride(1),
        BLOCK_M=16, BLOCK_N=64, BLOCK_K=block_k,
    )
    return out
