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

The gather copies every sequence's whole history out of the pages on every layer of every step (measured
in `agentbox bench step`: most of a long-context CPU decode step). When each sequence's pages are
consecutive (the pool hands out ascending runs, so a lone agent session's pages usually are), its keys are
one slice of the cache: the view path attends over that slice (`narrow`, no copy) one sequence at a time,
with the window narrowing the slice too, and folds each kv head's query group into the query rows so SDPA
needs no GQA expansion. Anything else (pages out of order) takes the gather, and so do batches of short
sequences, where one padded SDPA beats a Python loop of small ones (measured on this 2-core CPU, one
thread, 4 heads on 2 kv heads x 64: 32 decodes at 64 tokens 2.0 ms views vs 1.8 ms gather per layer,
at 128 tokens 3.6 vs 4.2, at 256 tokens 3.6 vs 15.3). Both give the same numbers
(tests/test_layers.py compares them on ragged batches with chunked prefill, sinks and windows).

On an AVX2 CPU with an fp32 or fp16 cache (fp16: the default CPU pool; the store below rounds into it, the kernel
widens as it reads), layers without a window or sinks skip all of that: kernels/cpu_attention.c
takes the whole step in one call, reading keys in place through the page table (any page order), the key
range of a long sequence split across the threads (a warm turn's ~25 tokens over 121k keys: 38-53 ms in
torch's fused kernel on one thread, ~12 ms of CPU in the kernel, split over the engine's threads). On CPUs
with AMX it sends a step's prefill chunks and longer warm turns to cpu_attention_amx.c (split-bf16 tile products,
~2.7x at 32k context) when the cache is fp32; `exact_cpu` (--exact-cpu) keeps them on the fp32 kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from agentbox.kernels import cpu_attention
from agentbox.layers.backends.base import AttentionBackend, AttentionMetadata, register_backend
from agentbox.layers.backends.prefix_attention import (
    extend_attention,
    page_runs,
    runs_attention,
    split_available,
)


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


@dataclass
class _SeqView:
    """One sequence on the view path: its queries are rows q_start .. q_start+q_len of the step, its visible
    keys the cache slots slot .. slot+k_len (consecutive pages), `mask` [q_len, k_len] or None (all visible)."""

    q_start: int
    q_len: int
    slot: int
    k_len: int
    mask: torch.Tensor | None


def consecutive_bases(meta: AttentionMetadata) -> list[int] | None:
    """Cache slot of position 0 of each sequence when every sequence's pages are consecutive, else None."""
    ps = meta.page_size
    table = meta.page_table.cpu().to(torch.int64)  # free on CPU; one small copy per step on GPU
    n_pages = torch.tensor([-(-kv // ps) for kv in meta.kv_lens], dtype=torch.int64)
    if table.shape[1] > 1:
        step_one = table[:, 1:] - table[:, :-1] == 1
        used = torch.arange(table.shape[1] - 1)[None, :] < (n_pages - 1)[:, None]
        if not bool((step_one | ~used).all()):
            return None
    return (table[:, 0] * ps).tolist()


def seq_views(meta: AttentionMetadata, bases: list[int], window: int | None, device: torch.device,
              masks: bool = True) -> list[_SeqView]:
    """masks=False: no mask is built (the caller attends causally without one: prefix_attention.py)."""
    views = []
    q_start = 0
    for base, q_len, kv_len in zip(bases, meta.query_lens, meta.kv_lens, strict=True):
        first = kv_len - q_len  # absolute position of the first new token
        lo = 0 if window is None else max(0, first - window + 1)
        mask = None
        if q_len > 1 and masks:
            key_pos = torch.arange(lo, kv_len)[None, :]
            query_pos = torch.arange(first, kv_len)[:, None]
            visible = key_pos <= query_pos
            if window is not None:
                visible &= key_pos > query_pos - window
            mask = visible.to(device)
        views.append(_SeqView(q_start, q_len, base + lo, kv_len - lo, mask))
        q_start += q_len
    return views


def check_layout(meta: AttentionMetadata) -> None:
    if meta.num_seqs == 0:
        raise ValueError("attention step with no sequences")
    for q_len, kv_len in zip(meta.query_lens, meta.kv_lens, strict=True):
        if q_len < 1 or kv_len < q_len:
            raise ValueError(f"bad step layout: query_len {q_len} with kv_len {kv_len}")


def build_layout(meta: AttentionMetadata, device: torch.device) -> _StepLayout:
    check_layout(meta)
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

    # False forces the gather path (the baseline of `agentbox bench step`, and the test's twin).
    use_views: bool = True
    # False keeps fp32 CPU steps off cpu_attention.c (tests and `bench step` that probe the paths below).
    use_cpu_kernel: bool = True
    # The view path runs when the step's sequences average at least this many keys (see the module notes).
    view_min_mean_kv: int = 128
    layout: _StepLayout | None = None
    window_masks: dict[int, torch.Tensor]
    bases: list[int] | None = None
    runs: list[list[tuple[int, int]]] | None = None  # per sequence: runs of consecutive slots (CPU)
    views: dict[int | None, list[_SeqView]]
    paged: bool = False  # this step's fp32 CPU layers go to cpu_attention.c
    planned: bool = False  # the views / runs / gather layout of this step are built

    def begin(self, meta: AttentionMetadata) -> None:
        super().begin(meta)
        check_layout(meta)
        # fp32 on an AVX2 CPU: cpu_attention.c reads every sequence's pages in place, so the views, runs
        # and gather below are planned only when a layer it does not take (a window, sinks) asks for them.
        self.paged = self.use_cpu_kernel and self.use_views and self.kv_cache.k[0].device.type == "cpu" and cpu_attention.available()
        self.planned = not self.paged
        if not self.paged:
            self._plan(meta)

    def _plan(self, meta: AttentionMetadata) -> None:
        self.planned = True
        long_enough = sum(meta.kv_lens) >= self.view_min_mean_kv * meta.num_seqs
        self.bases = consecutive_bases(meta) if self.use_views and long_enough else None
        # Pages out of order on CPU (a session's turns each add a run): attend run by run, no gather.
        self.runs = None
        if self.bases is None and self.use_views and long_enough and split_available(self.kv_cache.k[0]):
            table = meta.page_table.to(torch.int64)
            self.runs = [page_runs(table[i], meta.page_size, kv) for i, kv in enumerate(meta.kv_lens)]
        self.layout = build_layout(meta, self.kv_cache.k[0].device) if self.bases is None else None
        self.window_masks = {}
        self.views = {}

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
        scale: float | None = None,
    ) -> torch.Tensor:
        meta, lay = self.meta, self.layout
        scale = self.scale if scale is None else scale
        if meta is None:
            raise RuntimeError("TorchAttention.forward before begin(meta)")
        k_cache, v_cache = self.kv_cache.k[layer_id], self.kv_cache.v[layer_id]
        slot_mapping = meta.slot_mapping.to(k_cache.device, torch.int64)
        k_cache.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
        v_cache.index_copy_(0, slot_mapping, v.to(v_cache.dtype))
        if self.paged and sliding_window is None and sinks is None and cpu_attention.supports(q, k_cache):
            return cpu_attention.paged_attention(q, k_cache, v_cache, meta.page_table, meta.page_size,
                                                 meta.query_lens, meta.kv_lens, scale, meta.cpu_threads,
                                                 amx=False if self.exact_cpu else None)
        if not self.planned:
            self._plan(meta)
            lay = self.layout
        if self.bases is not None:
            return self._forward_views(q, k_cache, v_cache, sliding_window, sinks, scale)
        if self.runs is not None and sliding_window is None and sinks is None:
            outs, start = [], 0
            for runs, q_len in zip(self.runs, meta.query_lens, strict=True):
                outs.append(runs_attention(q.narrow(0, start, q_len), k_cache, v_cache, runs, scale))
                start += q_len
            return outs[0] if len(outs) == 1 else torch.cat(outs)
        assert lay is not None

        b, max_q, (_, h, d) = lay.num_seqs, lay.max_q, q.shape
        keys = k_cache[lay.kv_slots].to(q.dtype).transpose(1, 2)  # [B, Hkv, max_kv, D]
        values = v_cache[lay.kv_slots].to(q.dtype).transpose(1, 2)
        queries = q.new_zeros(b * max_q, h, d)
        queries[lay.q_index] = q
        queries = queries.view(b, max_q, h, d).transpose(1, 2)  # [B, H, max_q, D]
        mask = self._mask(lay, sliding_window)
        if sinks is not None:
            out = _attention_with_sinks(queries, keys, values, mask, scale, sinks)
        else:
            # enable_gqa: SDPA reads each kv head for its group of query heads, no repeat_interleave copies
            # (measured ~6 % of a CPU decode step).
            out = F.scaled_dot_product_attention(
                queries, keys, values, attn_mask=mask, scale=scale, enable_gqa=k_cache.shape[1] != h
            )
        return out.transpose(1, 2).reshape(b * max_q, h, values.shape[-1])[lay.q_index]

    def _forward_views(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        window: int | None,
        sinks: torch.Tensor | None,
        scale: float,
    ) -> torch.Tensor:
        assert self.meta is not None and self.bases is not None
        # Extends on CPU over the whole prefix (no window, no sinks) skip the mask (prefix_attention.py).
        split = window is None and sinks is None and split_available(q)
        if window not in self.views:
            self.views[window] = seq_views(self.meta, self.bases, window, k_cache.device, masks=not split)
        (_, h, d), hkv = q.shape, k_cache.shape[1]
        g = h // hkv
        outs = []
        for sv in self.views[window]:
            if split and sv.q_len > 1:
                keys = k_cache.narrow(0, sv.slot, sv.k_len).to(q.dtype).transpose(0, 1)
                values = v_cache.narrow(0, sv.slot, sv.k_len).to(q.dtype).transpose(0, 1)
                outs.append(extend_attention(q.narrow(0, sv.q_start, sv.q_len), keys, values, scale))
                continue
            # [1, Hkv, K, D] strided views of the cache (a copy only when the cache dtype differs from q's).
            keys = k_cache.narrow(0, sv.slot, sv.k_len).to(q.dtype).transpose(0, 1).unsqueeze(0)
            values = v_cache.narrow(0, sv.slot, sv.k_len).to(q.dtype).transpose(0, 1).unsqueeze(0)
            qs = q.narrow(0, sv.q_start, sv.q_len)  # [Q, H, D]
            if sinks is not None:
                mask = None if sv.mask is None else sv.mask[None, None]
                o = _attention_with_sinks(qs.transpose(0, 1).unsqueeze(0), keys, values, mask, scale, sinks)
                outs.append(o[0].transpose(0, 1))
                continue
            # Query head hk*g + j reads kv head hk: fold the group into the rows, [1, Hkv, g*Q, D].
            qf = qs.reshape(sv.q_len, hkv, g, d).permute(1, 2, 0, 3).reshape(1, hkv, g * sv.q_len, d)
            mask = None if sv.mask is None else sv.mask.repeat(g, 1)
            o = F.scaled_dot_product_attention(qf, keys, values, attn_mask=mask, scale=scale)
            outs.append(o.view(hkv, g, sv.q_len, d).permute(2, 0, 1, 3).reshape(sv.q_len, h, d))
        return outs[0] if len(outs) == 1 else torch.cat(outs)


def _attention_with_sinks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float, sinks: torch.Tensor
) -> torch.Tensor:
    """q [B, H, Q, D], k/v [B, Hkv, K, D], mask [B, 1, Q, K] bool or None (all visible), sinks [H] -> [B, H, Q, D].
    Query heads are grouped by kv head (a view, no copy of k/v); softmax in fp32."""
    b, h, nq, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(b, hkv, h // hkv, nq, d)
    scores = torch.einsum("bhgqd,bhkd->bhgqk", qg, k).float() * scale
    if mask is not None:
        scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
    sink = sinks.float().reshape(1, hkv, h // hkv, 1, 1).expand(b, -1, -1, nq, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    out = torch.einsum("bhgqk,bhkd->bhgqd", probs.to(v.dtype), v)
    return out.reshape(b, h, nq, d)
