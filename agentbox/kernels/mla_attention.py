"""Paged multi-head latent attention (MLA) in the absorbed form, for decode and for prefix-extend.

The cache holds one "head" per token: [latent (RANK) | rope key (ROPE)] (layers/backends/mla.py). A query
row is [q_nope W_UK (RANK) | q_pe (ROPE)] per head; its score against a key is q_lat . c + q_pe . k_pe and the
value is the latent c itself, so every head of a sequence reads the same cached rows (one KV head, all the
query heads grouped into the tile, as FlashMLA does). The output is the attended latent [T, H, RANK]; the
caller maps it through W_UV.

One kernel serves both steps: a program takes one query row (a token) and BLOCK_H of its heads, and walks
that row's visible keys (`visible[t]` of sequence `seq[t]`'s pages) with an online softmax. Decode: one row
per sequence, visible = kv_len. Extend (prefill chunks over a cached prefix): one row per new token,
visible = its position + 1 (causal). The grid depends on the row count only, and the kernel reads device
tensors only. No split over the KV length yet (flash-decoding): a long decode at batch 1 uses few programs.
"""

from __future__ import annotations

import torch

from agentbox.kernels._triton import HAS_TRITON, check_runnable, next_pow2, tl, triton

if HAS_TRITON:

    @triton.jit
    def _mla_kernel(
        q_ptr, c_ptr, pt_ptr, seq_ptr, vis_ptr, o_ptr,
        stride_qt, stride_qh, stride_cs, stride_pt, stride_ot, stride_oh,
        scale,
        NUM_HEADS: tl.constexpr, RANK: tl.constexpr, ROPE: tl.constexpr, PAGE_SIZE: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        t = tl.program_id(0)
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        seq = tl.load(seq_ptr + t)
        visible = tl.load(vis_ptr + t)
        mask_h = heads < NUM_HEADS
        offs_c = tl.arange(0, BLOCK_C)
        offs_r = tl.arange(0, BLOCK_R)
        mask_c = offs_c < RANK
        mask_r = offs_r < ROPE
        q_row = q_ptr + t * stride_qt + heads[:, None] * stride_qh
        q_c = tl.load(q_row + offs_c[None, :], mask=mask_h[:, None] & mask_c[None, :], other=0.0)
        q_r = tl.load(q_row + RANK + offs_r[None, :], mask=mask_h[:, None] & mask_r[None, :], other=0.0)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
        for n0 in range(0, visible, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            mask_n = pos < visible
            page = tl.load(pt_ptr + seq * stride_pt + pos // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
            slot = page * PAGE_SIZE + pos % PAGE_SIZE
            k_c = tl.load(c_ptr + slot[:, None] * stride_cs + offs_c[None, :],
                          mask=mask_n[:, None] & mask_c[None, :], other=0.0).to(q_c.dtype)
            k_r = tl.load(c_ptr + slot[:, None] * stride_cs + RANK + offs_r[None, :],
                          mask=mask_n[:, None] & mask_r[None, :], other=0.0).to(q_r.dtype)
            qk = tl.dot(q_c, tl.trans(k_c), input_precision="ieee")
            qk += tl.dot(q_r, tl.trans(k_r), input_precision="ieee")
            qk = tl.where(mask_n[None, :], qk * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(k_c.dtype), k_c, input_precision="ieee")
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a padded row (visible 0) writes zeros
        tl.store(o_ptr + t * stride_ot + heads[:, None] * stride_oh + offs_c[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=mask_h[:, None] & mask_c[None, :])


def _launch(q: torch.Tensor, cache: torch.Tensor, page_table: torch.Tensor, seq: torch.Tensor,
            visible: torch.Tensor, rank: int, page_size: int, scale: float, block_n: int) -> torch.Tensor:
    check_runnable(q, cache)
    rows, heads, width = q.shape
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty((rows, heads, rank), dtype=q.dtype, device=q.device)
    block_h = 16  # tl.dot needs every tile side >= 16
    _mla_kernel[(rows, triton.cdiv(heads, block_h))](
        q, cache, page_table, seq, visible, out,
        q.stride(0), q.stride(1), cache.stride(0), page_table.stride(0), out.stride(0), out.stride(1), scale,
        NUM_HEADS=heads, RANK=rank, ROPE=width - rank, PAGE_SIZE=page_size,
        BLOCK_H=block_h, BLOCK_C=max(16, next_pow2(rank)), BLOCK_R=max(16, next_pow2(width - rank)), BLOCK_N=block_n,
    )
    return out


def mla_decode(q: torch.Tensor, cache: torch.Tensor, page_table: torch.Tensor, kv_lens: torch.Tensor, *,
               rank: int, page_size: int, scale: float, block_n: int = 32) -> torch.Tensor:
    """q: [B, H, RANK + ROPE] one row per sequence; cache [num_slots, 1, RANK + ROPE]; page_table [B, max_pages]
    int32; kv_lens [B] int32 (0: a padded row, zeros out). Returns the attended latent [B, H, RANK]."""
    seq = torch.arange(q.shape[0], dtype=torch.int32, device=q.device)
    return _launch(q, cache, page_table, seq, kv_lens, rank, page_size, scale, block_n)


def extend_rows(query_start_loc: torch.Tensor, kv_lens: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each new token: its sequence and how many keys it sees (the new tokens are each sequence's last
    query_len, causal). Device tensors in, device tensors out (no host sync)."""
    counts = query_start_loc[1:] - query_start_loc[:-1]
    seq = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device, dtype=torch.int32), counts.long(),
                                  output_size=num_tokens)
    offset = torch.arange(num_tokens, device=counts.device, dtype=torch.int32) - query_start_loc[seq.long()]
    visible = kv_lens[seq.long()] - counts[seq.long()] + offset + 1
    return seq, visible.to(torch.int32)


def mla_extend(q: torch.Tensor, cache: torch.Tensor, page_table: torch.Tensor, query_start_loc: torch.Tensor,
               kv_lens: torch.Tensor, *, rank: int, page_size: int, scale: float, block_n: int = 32) -> torch.Tensor:
    """q: [T, H, RANK + ROPE] for the step's new tokens of every sequence (query_start_loc [B + 1] int32).
    Returns the attended latent [T, H, RANK]."""
    seq, visible = extend_rows(query_start_loc, kv_lens, q.shape[0])
    return _launch(q, cache, page_table, seq, visible, rank, page_size, scale, block_n)


def mla_attention_ref(q: torch.Tensor, cache: torch.Tensor, page_table: torch.Tensor, query_start_loc: torch.Tensor,
                      kv_lens: torch.Tensor, *, rank: int, page_size: int, scale: float) -> torch.Tensor:
    """The torch twin of both: each token's visible keys gathered from its pages, softmax in fp32."""
    seq, visible = extend_rows(query_start_loc, kv_lens, q.shape[0])
    out = torch.zeros(q.shape[0], q.shape[1], rank, dtype=q.dtype, device=q.device)
    for t in range(q.shape[0]):
        n = int(visible[t])
        pos = torch.arange(n, device=q.device)
        slots = page_table[int(seq[t])].long()[pos // page_size] * page_size + pos % page_size
        keys = cache[slots, 0].float()  # [n, RANK + ROPE]
        probs = torch.softmax(q[t].float() @ keys.T * scale, dim=-1)
        out[t] = (probs @ keys[:, :rank]).to(q.dtype)
    return out
