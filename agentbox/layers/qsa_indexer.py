"""Qwen3.8-Flash-Next's QSA indexer: which cached tokens each query of an indexed-attention layer attends
(transformers' `Qwen4ExpTextQSAIndexer` is the reference for the arithmetic).

Per token the indexer keeps one raw key [Dk] (the key half of `index_qk_proj`, before any norm or rope). At query
time the keys of each complete block of `compress_ratio` tokens from position 0 are averaged (in fp32, cast back),
RMS-normed (zero-centred weight) and rotated at the block's first position; a query (its own heads, normed and
rotated at its position) scores a block sum_h relu(q_h . key) / sqrt(Dk), and attends the best
`budget / compress_ratio` blocks plus its own incomplete block (the "tail": the tokens after its last complete
block, itself included), always.

Unlike GLM-5.3's pooled indexer (layers/kpool_indexer.py) the pool is a plain mean and the scores are not
weighted per head, but the selection is the same shape, and so is the causality argument there: a query uses only
blocks whose every token is at or before it. Ties go to the earlier block (a stable sort), so a prompt's answer
does not depend on how it was chunked.

What it caches: the raw key per token (one paged entry a token, replicated over tensor-parallel ranks); the pooled
keys are recomputed from them each step, which is what lets a session resume at any turn end without keeping
the incomplete block anywhere else.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from agentbox.layers.kpool_indexer import earliest_top_k
from agentbox.layers.linear import ReplicatedLinear
from agentbox.layers.rotary import RotaryEmbedding


class ZeroCenteredNorm(nn.Module):
    """norm(x) * (1 + w) in fp32, cast back (the checkpoint stores w around zero)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), self.weight.shape, 1.0 + self.weight.float(), self.eps).to(x.dtype)


class QSAIndexer(nn.Module):
    def __init__(self, config: Any, rotary: RotaryEmbedding, rotary_dim: int, prefix: str) -> None:
        super().__init__()
        self.heads, self.dim = config.indexer_n_heads, config.indexer_head_dim
        if config.indexer_kv_heads != 1:
            raise ValueError(f"QSA keeps one indexer key head, not {config.indexer_kv_heads}")
        self.ratio, self.budget = config.indexer_compress_ratio, config.indexer_budget
        if self.budget % self.ratio:
            raise ValueError(f"indexer_budget ({self.budget}) is not a multiple of indexer_compress_ratio ({self.ratio})")
        self.index_qk_proj = ReplicatedLinear(config.hidden_size, (self.heads + 1) * self.dim, bias=False,
                                              prefix=f"{prefix}.index_qk_proj")
        self.q_layernorm = ZeroCenteredNorm(self.dim, config.rms_norm_eps)
        self.k_layernorm = ZeroCenteredNorm(self.dim, config.rms_norm_eps)
        self.rotary, self.rotary_dim = rotary, rotary_dim  # the attention's rope, on the first rotary_dim dims

    def _rope(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        r = self.rotary_dim
        return torch.cat([self.rotary.rotate(positions, x[..., :r]), x[..., r:]], dim=-1)

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (queries [T, H, Dk] normed and rotated, raw keys [T, Dk]: what the cache keeps)."""
        q, k = self.index_qk_proj(x).split([self.heads * self.dim, self.dim], dim=-1)
        q = self.q_layernorm(q.reshape(-1, self.heads, self.dim))
        return self._rope(positions, q), k

    def select(self, q: torch.Tensor, cached: torch.Tensor, query_pos: torch.Tensor) -> torch.Tensor:
        """The tokens each query attends: a boolean [B, max_q, max_kv].

        q [B, max_q, H, Dk]: the step's queries, padded per sequence; cached [B, max_kv, Dk]: each sequence's raw
        keys (padding past its length); query_pos [B, max_q]: each padded query's position."""
        b, max_kv, _ = cached.shape
        r = self.ratio
        blocks = max_kv // r  # only complete blocks can be chosen: a partial one past max_kv never is
        chosen = torch.zeros(b, q.shape[1], blocks, dtype=torch.bool, device=q.device)
        if blocks:
            pooled = cached[:, : blocks * r].view(b, blocks, r, self.dim).float().mean(dim=2).to(cached.dtype)
            starts = torch.arange(blocks, device=q.device) * r
            keys = self._rope(starts.repeat(b), self.k_layernorm(pooled).view(b * blocks, 1, self.dim))
            keys = keys.view(b, blocks, self.dim).float()
            # one batched product, ReLU'd in place (einsum's copies of the [B, Q, H, P] block were most of a step)
            scores = torch.bmm(q.float().reshape(b, -1, self.dim), keys.transpose(1, 2)).relu_()
            scores = scores.view(b, q.shape[1], -1, blocks).sum(dim=2) / self.dim**0.5
            complete = (starts + r - 1)[None, None, :] <= query_pos[..., None]  # every token of it is visible
            scores = scores.masked_fill(~complete, float("-inf"))
            # ties (every head's ReLU off) go to the earlier block however the step's rows are shaped, so
            # prefill, chunks and decode choose alike
            chosen = earliest_top_k(scores, min(self.budget // r, blocks)) & complete  # not past the complete ones
        tokens = torch.zeros(b, q.shape[1], max_kv, dtype=torch.bool, device=q.device)
        tokens[..., : blocks * r] = chosen.repeat_interleave(r, dim=-1)
        j = torch.arange(max_kv, device=q.device)
        tail_start = (query_pos + 1) // r * r
        tokens |= (j >= tail_start[..., None]) & (j <= query_pos[..., None])
        return tokens
