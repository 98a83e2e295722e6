"""The torch twin of the paged attention kernels (decode and prefix-extend): plain per-sequence loops, fp32,
written for clarity, not speed. Both kernels' `_ref` functions are this one.

Layout: the step's new tokens are flattened; sequence i owns rows query_start[i] .. query_start[i+1] and its
new tokens are the last q_len of its kv_len tokens, so new token r sits at absolute position kv_len - q_len + r.
A key at position j is read from cache slot page_table[i, j // page_size] * page_size + j % page_size.

Masking: a query at position p sees keys max(0, p - W + 1) .. p (W = sliding_window; None = unbounded). This is
transformers' sliding-window convention too (its mask keeps kv_idx > q_idx - W, i.e. W keys including the query).
Sinks: sinks[h] is one extra logit per head, in the same (already scaled) units as q.k * scale, that joins
every row's softmax denominator and contributes no value (gpt-oss).
"""

from __future__ import annotations

import torch


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    query_start: torch.Tensor,
    kv_lens: torch.Tensor,
    page_size: int,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [T, H, D]; k_cache, v_cache: [num_slots, Hkv, D]; page_table: [B, max_pages]; query_start: [B + 1];
    kv_lens: [B]. Returns [T, H, D] in q's dtype. A sequence with kv_len 0 (a padded row) gets zeros."""
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[1]
    group = num_heads // num_kv_heads
    out = torch.zeros_like(q)
    starts, lens = query_start.tolist(), kv_lens.tolist()
    for i, kv_len in enumerate(lens):
        q_lo, q_hi = starts[i], starts[i + 1]
        q_len = q_hi - q_lo
        if q_len == 0 or kv_len == 0:
            continue
        pos = torch.arange(kv_len, device=q.device)
        slots = page_table[i].long()[pos // page_size] * page_size + pos % page_size
        keys = k_cache[slots].float().repeat_interleave(group, dim=1)  # [kv_len, H, D]
        values = v_cache[slots].float().repeat_interleave(group, dim=1)
        queries = q[q_lo:q_hi].float()  # [q_len, H, D]
        logits = torch.einsum("qhd,khd->hqk", queries, keys) * scale
        q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)
        visible = pos[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            visible &= pos[None, :] > q_pos[:, None] - sliding_window
        logits = logits.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            sink_col = sinks.float().view(num_heads, 1, 1).expand(num_heads, q_len, 1)
            probs = torch.cat([logits, sink_col], dim=-1).softmax(-1)[..., :-1]
        else:
            probs = logits.softmax(-1)
        out[q_lo:q_hi] = torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)
    return out
