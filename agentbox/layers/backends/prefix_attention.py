"""Attention of an extend (a prefill chunk or a warm turn's new tokens) over a long cached prefix, on CPU,
without a mask over the prefix.

The new tokens see every key of the prefix and, among themselves, the causal triangle. One SDPA call with
an explicit [queries, keys] boolean mask costs far more than the attention itself on CPU: building the mask
is queries x context work per step, and torch's CPU kernels run 2-3x slower with a mask than without
(77 new tokens over 121k keys, 2 kv heads of 16: 890 ms masked, 370 ms split, measured on this 2-core
EPYC under load). So the attention is split in two exact halves, each a fused kernel that also returns the
log-sum-exp of its scores: the prefix without a mask (the query group folded into the rows: no GQA copy of
the keys) and the new tokens' own keys with `is_causal` (a small copy: only the new tokens' keys). The
halves are merged by their log-sum-exps, which is the softmax over the union.
"""

from __future__ import annotations

import torch

# The fused CPU kernel that returns (out, logsumexp); absent on builds without it (then: the masked path).
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def split_available(q: torch.Tensor) -> bool:
    return _FLASH_CPU is not None and q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16)


def page_runs(pages: torch.Tensor, page_size: int, n_tokens: int) -> list[tuple[int, int]]:
    """Positions 0..n_tokens of a sequence on `pages` (int64, its row of the page table) as runs of
    consecutive cache slots: [(first slot, tokens)], in order. A session's turns each add a run."""
    n_pages = -(-n_tokens // page_size)
    row = pages[:n_pages]
    breaks = (torch.nonzero(row[1:] - row[:-1] != 1).flatten() + 1).tolist()
    out, start = [], 0
    for end in [*breaks, n_pages]:
        first_tok, last_tok = start * page_size, min(end * page_size, n_tokens)
        out.append((int(row[start]) * page_size, last_tok - first_tok))
        start = end
    return out


def runs_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, runs: list[tuple[int, int]],
                   scale: float) -> torch.Tensor:
    """Causal attention of q [Q, H, D] (the last Q positions) over a sequence whose keys lie in `runs` of
    the cache ([slots, Hkv, D]): each run of the prefix is one unmasked fused call on a view of the cache,
    the new tokens' own keys (gathered: Q slots) one causal call, all merged by log-sum-exp. No copy of
    the history, whatever the page order."""
    assert _FLASH_CPU is not None
    n_q, h, d = q.shape
    hkv = k_cache.shape[1]
    g = h // hkv
    total = sum(n for _, n in runs)
    prefix = total - n_q
    slots = torch.cat([torch.arange(s, s + n) for s, n in runs])[prefix:]
    tail_k = k_cache[slots].to(q.dtype).transpose(0, 1).repeat_interleave(g, 0).unsqueeze(0)
    tail_v = v_cache[slots].to(q.dtype).transpose(0, 1).repeat_interleave(g, 0).unsqueeze(0)
    out, lse = _FLASH_CPU(q.transpose(0, 1).unsqueeze(0), tail_k, tail_v, is_causal=True, scale=scale)[:2]
    acc_out, acc_lse = out[0].float(), lse[0].float()  # [H, Q, D], [H, Q]
    qf = q.reshape(n_q, hkv, g, d).permute(1, 2, 0, 3).reshape(1, hkv, g * n_q, d)
    pos = 0
    for slot, n in runs:
        n = min(n, prefix - pos)
        if n <= 0:
            break
        keys = k_cache.narrow(0, slot, n).to(q.dtype).transpose(0, 1).unsqueeze(0)
        values = v_cache.narrow(0, slot, n).to(q.dtype).transpose(0, 1).unsqueeze(0)
        o, l_ = _FLASH_CPU(qf, keys, values, scale=scale)[:2]
        o, l_ = o.reshape(h, n_q, d).float(), l_.reshape(h, n_q).float()
        top = torch.maximum(acc_lse, l_)
        w_a, w_o = torch.exp(acc_lse - top), torch.exp(l_ - top)
        acc_out = (acc_out * w_a.unsqueeze(-1) + o * w_o.unsqueeze(-1)) / (w_a + w_o).unsqueeze(-1)
        acc_lse = top + torch.log(w_a + w_o)
        pos += n
    return acc_out.to(q.dtype).transpose(0, 1)


def extend_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """q [Q, H, D] are the last Q positions of the sequence; keys/values [Hkv, K, D] (views of the cache,
    K >= Q) hold every position up to and including them. Returns [Q, H, D]: causal attention."""
    assert _FLASH_CPU is not None
    n_q, h, d = q.shape
    hkv, k_len, _ = keys.shape
    g = h // hkv
    prefix = k_len - n_q
    # The new tokens over their own keys, causally: [1, H, Q, D]; each kv head repeated for its query group.
    tail_k = keys[:, prefix:].repeat_interleave(g, 0).unsqueeze(0)
    tail_v = values[:, prefix:].repeat_interleave(g, 0).unsqueeze(0)
    out_t, lse_t = _FLASH_CPU(q.transpose(0, 1).unsqueeze(0), tail_k, tail_v, is_causal=True, scale=scale)[:2]
    out_t, lse_t = out_t[0], lse_t[0].float()  # [H, Q, D], [H, Q]
    if prefix == 0:
        return out_t.transpose(0, 1)
    # The prefix, visible to every new token: query head hk*g + j reads kv head hk, so the group folds into
    # the rows, [1, Hkv, g*Q, D], and the keys stay strided views of the cache.
    qf = q.reshape(n_q, hkv, g, d).permute(1, 2, 0, 3).reshape(1, hkv, g * n_q, d)
    out_p, lse_p = _FLASH_CPU(qf, keys[:, :prefix].unsqueeze(0), values[:, :prefix].unsqueeze(0), scale=scale)[:2]
    out_p, lse_p = out_p.reshape(h, n_q, d), lse_p.reshape(h, n_q).float()
    top = torch.maximum(lse_p, lse_t)
    w_p = torch.exp(lse_p - top).unsqueeze(-1)
    w_t = torch.exp(lse_t - top).unsqueeze(-1)
    out = (out_p.float() * w_p + out_t.float() * w_t) / (w_p + w_t)
    return out.to(q.dtype).transpose(0, 1)
