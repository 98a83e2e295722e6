"""The reference attention backend: gather each sequence's pages, one scaled_dot_product_attention per layer.

Runs anywhere torch runs (CPU fp32/bf16, CUDA). Every sequence of the step, decode or prefill chunk with a
cached prefix, goes through the same padded batch: keys [B, max_kv], queries [B, max_q], and a boolean mask
that says key j is visible to query i of a sequence iff j < kv_len and j <= kv_len - q_len + i (the new
tokens are the last q_len of the sequence's kv_len). The gather indices and mask depend only on the step's
layout, so `begin` builds them once and every layer reuses them.

Sliding windows narrow that mask per layer (key j visible to a query at absolute position p iff j > p - W),
built once per step and window size. Attention sinks (gpt-oss) need the softmax denominator, which SDPA
does not expose, so a layer with sinks runs the explicit matmul-softmax-matmul with the sink logit as one
extra column that is dropped before the value product.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from agentbox.layers.backends.base import AttentionBackend, AttentionMetadata, register_backend


@dataclass
class _StepLayout:
    kv_slots: torch.Tensor  # [B, max_kv] int64 cache slot of each key (clamped to a valid slot when padded)
    q_index: torch.Tensor  # [T] int64 row of each new token in the flattened [B * max_q] padded queries
    mask: torch.Tensor  # [B, 1, max_q, max_kv] bool, True = attend
    query_pos: torch.Tensor  # [B, 1, max_q, 1] int64 absolute position of each padded query row
    is_real: torch.Tensor  # [B, 1, max_q, 1] bool, False on padding rows
    num_seqs: int
    max_q: int
    max_kv: int


def build_layout(meta: AttentionMetadata, device: torch.device) -> _StepLayout:
    if meta.num_seqs == 0:
        raise ValueError("attention step with no sequences")
    for q_len, kv_len in zip(meta.query_lens, meta.kv_lens, strict=True):
        if q_len < 1 or kv_len < q_len:
            raise ValueError(f"bad step layout: query_len {q_len} with kv_len {kv_len}")
    b, max_q, max_kv = meta.num_seqs, max(meta.query_lens), max(meta.kv_lens)
    # Small index tensors are built on the host from the Python lists and moved once.
    q_lens = torch.tensor(meta.query_lens, dtype=torch.int64)
    kv_lens = torch.tensor(meta.kv_lens, dtype=torch.int64)
    seq_of_token = torch.repeat_interleave(torch.arange(b), q_lens)
    starts = torch.cumsum(q_lens, 0) - q_lens
    offset_in_seq = torch.arange(int(q_lens.sum())) - starts[seq_of_token]
    q_index = seq_of_token * max_q + offset_in_seq

    j = torch.arange(max_kv)
    i = torch.arange(max_q)
    visible = (j[None, None, :] < kv_lens[:, None, None]) & (
        j[None, None, :] <= (kv_lens - q_lens)[:, None, None] + i[None, :, None]
    )
    # Padded keys (j >= kv_len) reuse the sequence's last real slot; the mask hides them anyway.
    positions = torch.minimum(j[None, :], kv_lens[:, None] - 1)
    page_size = meta.page_size
    page_table = meta.page_table.to(device=device, dtype=torch.int64)
    positions = positions.to(device)
    pages = torch.gather(page_table, 1, positions // page_size)
    kv_slots = pages * page_size + positions % page_size
    query_pos = (kv_lens - q_lens)[:, None] + i[None, :]
    is_real = i[None, :] < q_lens[:, None]
    return _StepLayout(
        kv_slots=kv_slots,
        q_index=q_index.to(device),
        mask=visible.unsqueeze(1).to(device),
        query_pos=query_pos[:, None, :, None].to(device),
        is_real=is_real[:, None, :, None].to(device),
        num_seqs=b,
        max_q=max_q,
        max_kv=max_kv,
    )


@register_backend
class TorchAttention(AttentionBackend):
    name = "torch"

    layout: _StepLayout | None = None
    window_masks: dict[int, torch.Tensor]

    def begin(self, meta: AttentionMetadata) -> None:
        super().begin(meta)
        self.layout = build_layout(meta, self.kv_cache.k[0].device)
        self.window_masks = {}

    def _mask(self, lay: _StepLayout, window: int | None) -> torch.Tensor:
        if window is None:
            return lay.mask
        if window not in self.window_masks:
            j = torch.arange(lay.max_kv, device=lay.mask.device)
            # Padding rows keep the plain mask: a window past every real key would leave them all-masked.
            in_window = (j > lay.query_pos - window) | ~lay.is_real
            self.window_masks[window] = lay.mask & in_window
        return self.window_masks[window]

    def forward(
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        sliding_window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        meta, lay = self.meta, self.layout
        if meta is None or lay is None:
            raise RuntimeError("TorchAttention.forward before begin(meta)")
        k_cache, v_cache = self.kv_cache.k[layer_id], self.kv_cache.v[layer_id]
        slot_mapping = meta.slot_mapping.to(k_cache.device, torch.int64)
        k_cache.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
        v_cache.index_copy_(0, slot_mapping, v.to(v_cache.dtype))

        b, max_q, h, d = lay.num_seqs, lay.max_q, self.num_heads, self.head_dim
        keys = k_cache[lay.kv_slots].to(q.dtype).transpose(1, 2)  # [B, Hkv, max_kv, D]
        values = v_cache[lay.kv_slots].to(q.dtype).transpose(1, 2)
        queries = q.new_zeros(b * max_q, h, d)
        queries[lay.q_index] = q
        queries = queries.view(b, max_q, h, d).transpose(1, 2)  # [B, H, max_q, D]
        mask = self._mask(lay, sliding_window)
        if sinks is not None:
            out = _attention_with_sinks(queries, keys, values, mask, self.scale, sinks)
        else:
            # enable_gqa: SDPA reads each kv head for its group of query heads, no repeat_interleave copies
            # (measured ~6 % of a CPU decode step).
            out = F.scaled_dot_product_attention(
                queries, keys, values, attn_mask=mask, scale=self.scale, enable_gqa=self.num_kv_heads != h
            )
        return out.transpose(1, 2).reshape(b * max_q, h, d)[lay.q_index]


def _attention_with_sinks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, sinks: torch.Tensor
) -> torch.Tensor:
    """q [B, H, Q, D], k/v [B, Hkv, K, D], mask [B, 1, Q, K] bool, sinks [H] -> [B, H, Q, D].
    Query heads are grouped by kv head (a view, no copy of k/v); softmax in fp32."""
    b, h, nq, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(b, hkv, h // hkv, nq, d)
    scores = torch.einsum("bhgqd,bhkd->bhgqk", qg, k).float() * scale
    scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
    sink = sinks.float().reshape(1, hkv, h // hkv, 1, 1).expand(b, -1, -1, nq, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    out = torch.einsum("bhgqk,bhkd->bhgqd", probs.to(v.dtype), v)
    return out.reshape(b, h, nq, d)
