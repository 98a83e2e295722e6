"""Prefix-extend attention: each sequence's new tokens (a prefill chunk, a prompt after a cache hit, a decode)
attend to all of its cached keys and causally to each other, read straight from the page tables.

The new tokens' k/v are stored in the cache first (kernels/store_kv.py), so cached prefix and new tokens are
one range of positions 0 .. kv_len - 1 and one loop serves both. Grid (batch, token blocks, kv heads):
program (i, t, h) takes a few consecutive new tokens of sequence i for all the query heads of KV head h (GQA:
its K/V tiles are loaded once for the group; block_m rows of (token, head) per program); blocks past the
sequence's q_len exit at once, so ragged batches cost only a few empty programs. Keys are walked from the earliest position the
block can see (its sliding window) to its last query's position. A sink starts the online softmax as one
extra logit with no value. Masking and sinks follow kernels/attention_ref.py.
"""

from __future__ import annotations

import torch

from agentbox.kernels._triton import HAS_TRITON, check_runnable, next_pow2, tl, triton, window_arg
from agentbox.kernels.attention_ref import paged_attention_ref

if HAS_TRITON:

    @triton.jit
    def _prefix_extend_kernel(
        q_ptr, k_ptr, v_ptr, o_ptr, pt_ptr, q_start_ptr, kv_len_ptr, sink_ptr,
        stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ot, stride_oh, stride_pt,
        scale, window,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
        HAS_SINKS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        # Tile rows are (token, head of the group) pairs, BLOCK_T tokens x GROUP_PAD heads: the group's heads
        # share every K/V tile they load.
        b = tl.program_id(0)
        tblk = tl.program_id(1)
        kvh = tl.program_id(2)
        q_lo = tl.load(q_start_ptr + b)
        q_len = tl.load(q_start_ptr + b + 1) - q_lo
        if tblk * BLOCK_T >= q_len:
            return
        kv_len = tl.load(kv_len_ptr + b)
        ctx = kv_len - q_len  # tokens cached before this step's first new token

        offs_r = tl.arange(0, BLOCK_T * GROUP_PAD)
        tok = tblk * BLOCK_T + offs_r // GROUP_PAD
        g = offs_r % GROUP_PAD
        heads = kvh * GROUP + g
        mask_r = (tok < q_len) & (g < GROUP)
        q_pos = ctx + tok
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < HEAD_DIM
        rows = (q_lo + tok).to(tl.int64)
        q = tl.load(
            q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
            mask=mask_r[:, None] & mask_d[None, :], other=0.0,
        )
        if HAS_SINKS:
            m_i = tl.load(sink_ptr + heads, mask=mask_r, other=0.0).to(tl.float32)
            l_i = tl.full([BLOCK_T * GROUP_PAD], 1.0, tl.float32)  # exp(sink - m_i)
        else:
            m_i = tl.full([BLOCK_T * GROUP_PAD], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_T * GROUP_PAD], tl.float32)
        acc = tl.zeros([BLOCK_T * GROUP_PAD, BLOCK_D], tl.float32)

        last = tl.minimum(ctx + (tblk + 1) * BLOCK_T, kv_len)  # one past the block's last query position
        first = tl.maximum(ctx + tblk * BLOCK_T - window + 1, 0)
        for n0 in range(first, last, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            mask_n = pos < last
            page = tl.load(pt_ptr + b * stride_pt + pos // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
            slot = page * PAGE_SIZE + pos % PAGE_SIZE
            kv_mask = mask_n[:, None] & mask_d[None, :]
            k = tl.load(k_ptr + slot[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
            qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision="ieee") * scale
            visible = (
                mask_n[None, :] & (pos[None, :] <= q_pos[:, None]) & (pos[None, :] > q_pos[:, None] - window)
            )
            qk = tl.where(visible, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            # A row may see nothing in this block (window start, padded rows): keep its exps at 0, not NaN.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(qk - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + slot[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision="ieee")
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            o_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(o_ptr.dtype.element_ty), mask=mask_r[:, None] & mask_d[None, :],
        )


def prefix_extend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    query_start: torch.Tensor,
    kv_lens: torch.Tensor,
    *,
    max_query_len: int,
    page_size: int,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    block_m: int = 16,
    block_n: int = 32,
) -> torch.Tensor:
    """q: [T, H, D] (the step's new tokens, flattened); caches [num_slots, Hkv, D] already holding the new
    tokens' k/v; page_table [B, max_pages] int32; query_start [B + 1] int32; kv_lens [B] int32.
    max_query_len: the longest q_len of the batch (sizes the grid). Returns [T, H, D] in q's dtype."""
    check_runnable(q, k_cache)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    batch = kv_lens.shape[0]
    group = num_heads // num_kv_heads
    group_pad = next_pow2(group)
    block_t = max(block_m, group_pad) // group_pad  # tokens per program: block_m rows of (token, head)
    grid = (batch, triton.cdiv(max_query_len, block_t), num_kv_heads)
    _prefix_extend_kernel[grid](
        q, k_cache, v_cache, out, page_table, query_start, kv_lens, sinks if sinks is not None else q,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), page_table.stride(0), scale, window_arg(sliding_window),
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, PAGE_SIZE=page_size, HAS_SINKS=sinks is not None,
        BLOCK_T=block_t, BLOCK_D=next_pow2(head_dim), BLOCK_N=block_n,
    )
    return out


def prefix_extend_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    query_start: torch.Tensor,
    kv_lens: torch.Tensor,
    *,
    max_query_len: int,
    page_size: int,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    del max_query_len  # the reference loops over the real lengths
    return paged_attention_ref(
        q, k_cache, v_cache, page_table, query_start, kv_lens, page_size, scale, sliding_window, sinks
    )
