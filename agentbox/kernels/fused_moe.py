"""Fused MoE: every expert's tokens in one grouped GEMM per projection (Triton), and its torch twin.

The routed (token, slot) pairs are sorted by expert and each expert's run padded to a multiple of BLOCK_M
(`align_to_experts`), so a BLOCK_M row tile of the sorted list belongs to one expert. One launch then
covers all experts: program (m, n) multiplies its tile's rows by its expert's weight columns [n*BLOCK_N, ..).
The gate_up GEMM gathers token rows of x (pair p reads row p // top_k); the down GEMM reads the pair's
own intermediate row and multiplies by its routing weight, so the final sum over k is a plain reshape-sum.
Activation and biases run between the two launches in torch (one elementwise pass).

The experts' weights are read through an `ExpertWeights` (format, codes, scales, strides): dense here, and
int4 / k-bit / FP8 block / MXFP4 from kernels/fused_moe_quant.py, dequantised tile by tile in the K loop by
the tile decoders the dense w4a16 / w8a16 / wbits kernels share (kernels/_quant_triton.py), so quantised
experts stay quantised in memory and one kernel serves every format.

Alignment is computed on the device with sizes that depend only on T, k and E (an upper bound on the
padded length), so there is no host sync per layer and the launch grid is fixed for a batch size.
Under TRITON_INTERPRET=1 (CPU tests): fp32 / fp16 only, no bf16 tl.dot, no autotune.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from agentbox.kernels._quant_triton import (
    HAS_TRITON,
    WeightFormat,
    check_runnable,
    load_bits_tile,
    load_weight_tile,
    tl,
    triton,
)

BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 32


def triton_available() -> bool:
    return HAS_TRITON


def align_to_experts(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs [P], block_expert [P // block_m]) with P = T*k + E*(block_m - 1) rounded up to block_m.

    sorted_pairs lists pair indices (t * k + slot) grouped by expert, each group padded to a multiple of
    block_m with T*k (an index past every pair: the kernels mask it). block_expert[b] is the expert of tile
    b, or -1 for tiles past the last group."""
    flat = topk_ids.flatten()
    n = flat.numel()
    cap = -(-(n + num_experts * (block_m - 1)) // block_m) * block_m
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    group_start = torch.cumsum(padded, 0) - padded
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    first_of_expert = torch.cumsum(counts, 0) - counts
    rank_in_expert = torch.arange(n, device=flat.device) - first_of_expert[sorted_experts]
    sorted_pairs = torch.full((cap,), n, dtype=torch.int64, device=flat.device)
    sorted_pairs[group_start[sorted_experts] + rank_in_expert] = order
    tile_start = torch.arange(0, cap, block_m, device=flat.device)
    block_expert = torch.searchsorted(torch.cumsum(padded, 0), tile_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    return sorted_pairs, block_expert


@dataclass(frozen=True)
class ExpertWeights:
    """One projection of every expert as the grouped GEMM reads it: n outputs from k inputs, decoded by
    `format` (kernels/_quant_triton.py). Strides are in elements of each tensor, as (expert, k, n) for the
    scale and offset and (expert, n, k) for the codes (k counted in the codes' own elements: an int4 word
    holds 8 rows of K, an MXFP4 byte 2). `k_group` / `n_group`: inputs / outputs sharing one scale.
    `bits` > 4: the k-bit form (kernels/dequant.py) as INT4 codes (its low nibbles) plus `high`, the
    remaining bits, read by `load_bits_tile`; `offset` None there means the symmetric 2^(bits-1) shift."""

    format: WeightFormat
    codes: torch.Tensor
    n: int
    k: int
    code_strides: tuple[int, int, int]
    scale: torch.Tensor | None = None
    scale_strides: tuple[int, int, int] = (0, 0, 0)
    offset: torch.Tensor | None = None
    offset_strides: tuple[int, int, int] = (0, 0, 0)
    k_group: int = 1
    n_group: int = 1
    perm: torch.Tensor | None = None  # [E, K] int: stored row j of K reads input perm[e, j] (GPTQ act-order)
    bits: int = 0
    high: torch.Tensor | None = None  # int32 [E, K (bits-4) / 32, N] for bits > 4
    high_strides: tuple[int, int, int] = (0, 0, 0)  # (expert, n, k) as code_strides

    @staticmethod
    def dense(w: torch.Tensor) -> ExpertWeights:
        """w [E, N, K] in a float dtype."""
        return ExpertWeights(WeightFormat.DENSE, w, w.shape[1], w.shape[2], (w.stride(0), w.stride(1), w.stride(2)))

    @property
    def num_experts(self) -> int:
        return self.codes.shape[0]


if HAS_TRITON:

    @triton.jit
    def _grouped_gemm_kernel(
        a_ptr, b_ptr, h_ptr, s_ptr, o_ptr, perm_ptr, c_ptr, pairs_ptr, block_expert_ptr, weight_ptr,
        num_pairs, N, K, K_GROUP, N_GROUP,
        stride_am, stride_be, stride_bn, stride_bk, stride_he, stride_hn, stride_hk, stride_se, stride_sk, stride_sn,
        stride_oe, stride_ok, stride_on, stride_pe, stride_cm,
        ROW_DIV: tl.constexpr, MUL_WEIGHT: tl.constexpr, FORMAT: tl.constexpr, HAS_PERM: tl.constexpr,
        BITS: tl.constexpr, HAS_OFFSET: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        expert = tl.load(block_expert_ptr + pid_m)
        if expert < 0:
            return
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pairs = tl.load(pairs_ptr + offs_m)
        valid = pairs < num_pairs
        rows = pairs // ROW_DIV  # gate_up: the pair's token row of x; down: the pair's own row
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        b_expert = b_ptr + expert * stride_be
        h_expert = h_ptr + expert * stride_he
        s_expert = s_ptr + expert * stride_se
        o_expert = o_ptr + expert * stride_oe
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            kmask = kk < K
            if HAS_PERM:  # the expert's stored rows are sorted by group: gather the inputs they stand for
                cols = tl.load(perm_ptr + expert * stride_pe + kk, mask=kmask, other=0)
            else:
                cols = kk
            a = tl.load(a_ptr + rows[:, None] * stride_am + cols[None, :], mask=valid[:, None] & kmask[None, :], other=0.0)
            if BITS > 4:  # the k-bit form: int4 low nibbles in b, the high bits in h
                b = load_bits_tile(b_expert, h_expert, s_expert, o_expert, k0, kk, offs_n, kmask, nmask,
                                   stride_bk, stride_bn, stride_hk, stride_hn, stride_sk, stride_sn, stride_ok,
                                   stride_on, K_GROUP, BITS, HAS_OFFSET)
            else:
                b = load_weight_tile(b_expert, s_expert, o_expert, k0, kk, offs_n, kmask, nmask,
                                     stride_bk, stride_bn, stride_sk, stride_sn, stride_ok, stride_on,
                                     K_GROUP, N_GROUP, FORMAT)
            acc += tl.dot(a, b.to(a.dtype), input_precision="ieee")  # fp32: no TF32, as torch does
        if MUL_WEIGHT:
            w = tl.load(weight_ptr + pairs, mask=valid, other=0.0)
            acc = acc * w[:, None]
        tl.store(c_ptr + pairs[:, None] * stride_cm + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
                 mask=valid[:, None] & nmask[None, :])


def _grouped_gemm(
    a: torch.Tensor, w: ExpertWeights, pairs: torch.Tensor, block_expert: torch.Tensor, num_pairs: int,
    row_div: int, weights: torch.Tensor | None,
) -> torch.Tensor:
    """c[p] = a[p // row_div] @ W[expert(p)].T (times weights[p]) for every routed pair p; c: [num_pairs, N].
    A K tile reads one scale row, so BLOCK_K shrinks to a group of 16 (GGUF Q6_K), tl.dot's smallest K."""
    block_k = BLOCK_K if w.format is WeightFormat.DENSE else min(BLOCK_K, w.k_group)
    if w.format is not WeightFormat.DENSE and (w.k_group % block_k or block_k < 16):
        raise ValueError(f"fused MoE: a scale group of {w.k_group} inputs is not a multiple of 16 or {BLOCK_K}")
    if a.shape[1] != w.k:
        raise ValueError(f"fused MoE: activations have {a.shape[1]} features, the experts take {w.k}")
    c = torch.empty(num_pairs, w.n, dtype=a.dtype, device=a.device)
    a = a.contiguous()
    scale = w.scale if w.scale is not None else c
    offset = w.offset if w.offset is not None else scale
    perm = w.perm if w.perm is not None else pairs
    high = w.high if w.high is not None else w.codes
    grid = (block_expert.numel(), triton.cdiv(w.n, BLOCK_N))
    _grouped_gemm_kernel[grid](
        a, w.codes, high, scale, offset, perm, c, pairs, block_expert, weights if weights is not None else c,
        num_pairs, w.n, w.k, w.k_group, w.n_group,
        a.stride(0), *w.code_strides, *w.high_strides, *w.scale_strides, *w.offset_strides, perm.stride(0),
        c.stride(0),
        ROW_DIV=row_div, MUL_WEIGHT=weights is not None, FORMAT=w.format.value, HAS_PERM=w.perm is not None,
        BITS=w.bits, HAS_OFFSET=w.offset is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=block_k,
    )
    return c


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H] (gate rows, then up); w2 [E, H, I]; topk_* [T, k]. Returns [T, H]."""
    return fused_moe_experts(
        x, ExpertWeights.dense(w13), ExpertWeights.dense(w2), topk_weights, topk_ids, act, w13_bias, w2_bias
    )


def fused_moe_experts(
    x: torch.Tensor,
    w13: ExpertWeights,
    w2: ExpertWeights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """fused_moe over experts in any format the tile decoder reads (kernels/fused_moe_quant.py builds them)."""
    check_runnable(x, w13.codes)
    t, k = topk_ids.shape
    num_pairs = t * k
    pairs, block_expert = align_to_experts(topk_ids, w13.num_experts, BLOCK_M)
    flat_ids = topk_ids.flatten()
    inter = _grouped_gemm(x, w13, pairs, block_expert, num_pairs, k, None)  # [T*k, 2I]
    if w13_bias is not None:
        inter = inter + w13_bias[flat_ids].to(inter.dtype)
    h = act(inter)
    weights = topk_weights.flatten().to(torch.float32).contiguous()
    if w2_bias is None:
        out = _grouped_gemm(h, w2, pairs, block_expert, num_pairs, 1, weights)
    else:  # the bias is weighted with its expert's output: add it before the weight, in torch
        out = _grouped_gemm(h, w2, pairs, block_expert, num_pairs, 1, None)
        out = (out + w2_bias[flat_ids].to(out.dtype)) * weights[:, None].to(out.dtype)
    return out.view(t, k, -1).sum(dim=1)


def fused_moe_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The torch twin: one expert at a time over the tokens routed to it."""
    out = torch.zeros_like(x)
    for e in torch.unique(topk_ids).tolist():
        token, slot = torch.where(topk_ids == e)
        h = F.linear(x[token], w13[e], None if w13_bias is None else w13_bias[e])
        y = F.linear(act(h), w2[e], None if w2_bias is None else w2_bias[e])
        out.index_add_(0, token, y * topk_weights[token, slot, None].to(x.dtype))
    return out
