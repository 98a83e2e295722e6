"""Paged decode attention (one new token per sequence), split over the KV length (flash-decoding) with the
query heads of one KV head grouped into one tile (GQA), read straight from our page tables.

Stage 1, grid (batch, kv_heads, num_splits): each program walks its share of the sequence's visible keys
(BLOCK_N at a time; each key's slot comes from the page table, so any page size works, 1 included) for the
GROUP query heads that share its KV head, with an online softmax, and writes a normalised partial output and
its log-sum-exp. Stage 2, grid (batch, kv_heads): merges the splits' partials by their log-sum-exps; the head's
sink logit (if any) joins the denominator there. The grid depends only on the batch size, never on lengths,
so a CUDA graph captured at one batch size replays for any context (num_splits is fixed per backend).

Masking and sinks follow kernels/attention_ref.py (sliding window W: keys max(0, p - W + 1) .. p).
"""

from __future__ import annotations

import torch

from agentbox.kernels._triton import HAS_TRITON, check_runnable, next_pow2, tl, triton, window_arg
from agentbox.kernels.attention_ref import paged_attention_ref

if HAS_TRITON:

    @triton.jit
    def _decode_split_kernel(
        q_ptr, k_ptr, v_ptr, pt_ptr, kv_len_ptr, mid_o_ptr, mid_lse_ptr,
        stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_pt,
        scale, window,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        kv_len = tl.load(kv_len_ptr + b)
        start = tl.maximum(kv_len - window, 0)
        per_split = tl.cdiv(tl.cdiv(kv_len - start, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = start + split * per_split
        hi = tl.minimum(lo + per_split, kv_len)

        offs_h = tl.arange(0, BLOCK_H)
        heads = kvh * GROUP + offs_h
        mask_h = offs_h < GROUP
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < HEAD_DIM
        q = tl.load(
            q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
            mask=mask_h[:, None] & mask_d[None, :], other=0.0,
        )
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        for n0 in range(lo, hi, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            mask_n = pos < hi
            page = tl.load(pt_ptr + b * stride_pt + pos // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
            slot = page * PAGE_SIZE + pos % PAGE_SIZE
            kv_mask = mask_n[:, None] & mask_d[None, :]
            k = tl.load(k_ptr + slot[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
            qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision="ieee") * scale
            qk = tl.where(mask_n[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + slot[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision="ieee")
            m_i = m_new
        # A split with no keys (short sequence, padded row) reports lse = -inf and output 0: stage 2 skips it.
        has = l_i > 0
        out = acc / tl.where(has, l_i, 1.0)[:, None]
        lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
        row = b * (GROUP * tl.num_programs(1)) + heads
        tl.store(
            mid_o_ptr + (row[:, None] * NUM_SPLITS + split) * HEAD_DIM + offs_d[None, :], out,
            mask=mask_h[:, None] & mask_d[None, :],
        )
        tl.store(mid_lse_ptr + row * NUM_SPLITS + split, lse, mask=mask_h)

    @triton.jit
    def _decode_merge_kernel(
        mid_o_ptr, mid_lse_ptr, sink_ptr, o_ptr, stride_ob, stride_oh,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, HAS_SINKS: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        # One program per (sequence, KV head) merges its GROUP query heads, two passes over the splits.
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        offs_h = tl.arange(0, BLOCK_H)
        mask_h = offs_h < GROUP
        heads = kvh * GROUP + offs_h
        rows = b * (GROUP * tl.num_programs(1)) + heads
        offs_d = tl.arange(0, BLOCK_D)
        mask = mask_h[:, None] & (offs_d[None, :] < HEAD_DIM)
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        for s in tl.static_range(NUM_SPLITS):
            m = tl.maximum(m, tl.load(mid_lse_ptr + rows * NUM_SPLITS + s, mask=mask_h, other=float("-inf")))
        if HAS_SINKS:
            sink = tl.load(sink_ptr + heads, mask=mask_h, other=0.0).to(tl.float32)
            m = tl.maximum(m, sink)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        denom = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        for s in tl.static_range(NUM_SPLITS):
            w = tl.exp(tl.load(mid_lse_ptr + rows * NUM_SPLITS + s, mask=mask_h, other=float("-inf")) - m_safe)
            part = tl.load(mid_o_ptr + (rows[:, None] * NUM_SPLITS + s) * HEAD_DIM + offs_d[None, :], mask=mask, other=0.0)
            acc += part * w[:, None]
            denom += w
        if HAS_SINKS:
            denom += tl.exp(sink - m_safe)
        out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
        tl.store(
            o_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :], out.to(o_ptr.dtype.element_ty),
            mask=mask,
        )


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    kv_lens: torch.Tensor,
    *,
    page_size: int,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    num_splits: int = 8,
    block_n: int = 32,
) -> torch.Tensor:
    """q: [B, H, D] (last dim contiguous); caches [num_slots, Hkv, D]; page_table [B, max_pages] int32;
    kv_lens [B] int32 (0 = a padded row, output zeros). Returns [B, H, D] in q's dtype."""
    check_runnable(q, k_cache)
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    if q.stride(-1) != 1:
        q = q.contiguous()
    mid_o = torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    block_d = next_pow2(head_dim)
    # tl.dot needs every tile side >= 16: small GQA groups are padded with masked heads.
    block_h = max(16, next_pow2(group))
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, page_table, kv_lens, mid_o, mid_lse,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        page_table.stride(0), scale, window_arg(sliding_window),
        GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=page_size, NUM_SPLITS=num_splits,
        BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_N=block_n,
    )
    _decode_merge_kernel[(batch, num_kv_heads)](
        mid_o, mid_lse, sinks if sinks is not None else mid_lse, out, out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, NUM_SPLITS=num_splits, HAS_SINKS=sinks is not None,
        BLOCK_H=block_h, BLOCK_D=block_d,
    )
    return out


def paged_decode_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    kv_lens: torch.Tensor,
    *,
    page_size: int,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    query_start = torch.arange(q.shape[0] + 1, device=q.device)
    return paged_attention_ref(
        q, k_cache, v_cache, page_table, query_start, kv_lens, page_size, scale, sliding_window, sinks
    )
