"""GLM-5.3-Flash's DSA indexer with pooled keys: which cached tokens each query of an indexed-attention layer
attends (transformers' `Glm5NextTextIndexer` is the reference for the arithmetic).

Per token the indexer keeps a key k = LayerNorm(wk x) [Dk] and a pooling logit row c = x W_gate^T [Dk]. Keys are
pooled in groups of `kpool` tokens from position 0: pool j's key is sum_t softmax_t(c_t + ape[t - j*kpool]) * k_t
over its tokens (per channel). A query scores the pools with its own heads: sum_h w_h relu(q_h . key_j / sqrt(Dk))
(q = wq_b of the attention's low-rank query, w = weights_proj x / sqrt(heads)), keeps the best
`index_topk / kpool` pools, and attends their tokens plus its own incomplete pool (the "tail": the tokens after
its last complete pool, itself included), always.

Causality: a query at position p may use only pools whose every token is at or before p, and its tail is the
tokens from the last multiple of kpool through p. That is what transformers' token-by-token decode computes;
its full forward agrees with it (we found no key reaching past a query), except where two pools' scores tie
exactly, which topk breaks by the width of the row (docs/models-and-formats.md says what we measured). We break
ties by pool order, so a prompt's answer does not depend on how it was chunked.

What it caches: k and c per token ([2 Dk], one paged entry a token, replicated over tensor-parallel ranks); the
pooled keys are recomputed from them each step (cheap beside the attention; a token-granular entry is what
lets a session resume at any turn end without a ring for the incomplete pool).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from agentbox.layers.linear import ReplicatedLinear


def earliest_top_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    """A boolean mask of each row's k best entries, ties at the k-th score going to the earliest: the set a stable
    descending sort's first k hold. topk alone breaks ties by where entries sit in a row whose width is the step's
    pool count, so the same query would pick differently prefilled whole, chunked or decoded; the sort cost 12x
    topk at 1,024 queries over 1,000 pools (88 against 7 ms), a fifth of a GLM-5.3 prefill step."""
    if k <= 0:
        return torch.zeros_like(scores, dtype=torch.bool)
    kth = scores.topk(k, dim=-1).values[..., -1:]
    above = scores > kth
    tied = scores == kth
    room = k - above.sum(dim=-1, keepdim=True)  # places left for entries tied with the k-th
    return above | (tied & (tied.cumsum(dim=-1) <= room))


class KPoolIndexer(nn.Module):
    def __init__(self, config: Any, prefix: str) -> None:
        super().__init__()
        self.heads, self.dim = config.index_n_heads, config.index_head_dim
        self.kpool, self.topk = config.index_kpool, config.index_topk
        if self.topk % self.kpool:
            raise ValueError(f"index_topk ({self.topk}) is not a multiple of index_kpool ({self.kpool})")
        self.always_tail = bool(getattr(config, "index_kpool_always_select_tail", True))
        hidden = config.hidden_size
        self.wq_b = ReplicatedLinear(config.q_lora_rank, self.heads * self.dim, prefix=f"{prefix}.wq_b")
        self.wk = ReplicatedLinear(hidden, self.dim, prefix=f"{prefix}.wk")
        self.k_norm = nn.LayerNorm(self.dim, eps=1e-6)
        self.k_norm.requires_grad_(False)
        self.weights_proj = ReplicatedLinear(hidden, self.heads, prefix=f"{prefix}.weights_proj")
        self.index_kpool_compress_ape = nn.Parameter(torch.zeros(self.kpool, self.dim), requires_grad=False)
        self.index_kpool_compress_gate = nn.Parameter(torch.zeros(self.dim, hidden), requires_grad=False)

    def entries(self, x: torch.Tensor) -> torch.Tensor:
        """What the cache keeps per token: [T, 2 Dk] = [key | pooling logits]."""
        key = self.k_norm(self.wk(x))
        return torch.cat([key, F.linear(x, self.index_kpool_compress_gate.to(x.dtype))], dim=-1)

    def pooled_keys(self, cached: torch.Tensor) -> torch.Tensor:
        """cached [B, N, 2 Dk] (N a multiple of kpool) -> the pool keys [B, N / kpool, Dk] in fp32."""
        b, n, _ = cached.shape
        key, logits = cached.view(b, n // self.kpool, self.kpool, 2 * self.dim).split(self.dim, dim=-1)
        weights = (logits.float() + self.index_kpool_compress_ape.float()).softmax(dim=2)
        return (weights * key.float()).sum(dim=2)

    def select(self, x: torch.Tensor, q_residual: torch.Tensor, cached: torch.Tensor, query_pos: torch.Tensor,
               padded: Any) -> torch.Tensor:
        """The tokens each query attends: a boolean [B, max_q, max_kv].

        x [T, hidden], q_residual [T, q_lora_rank]: the step's tokens; cached [B, max_kv, 2 Dk]: each sequence's
        entries (padding past its length); query_pos [B, max_q]: each padded query's position; `padded` maps a
        [T, ...] tensor to [B, max_q, ...]."""
        b, max_kv, _ = cached.shape
        pools = -(-max_kv // self.kpool)
        cached = F.pad(cached, (0, 0, 0, pools * self.kpool - max_kv))
        keys = self.pooled_keys(cached)  # [B, P, Dk]
        q = padded(self.wq_b(q_residual).view(-1, self.heads, self.dim)).float()  # [B, Q, H, Dk]
        w = padded(self.weights_proj(x)).float() * self.heads**-0.5  # [B, Q, H]
        # Two batched products, the big [B, Q x H, P] block scaled and ReLU'd in place (einsum's copies were half
        # of a prefill step); the head sum is the bmm einsum itself ran for it.
        scores = torch.bmm(q.reshape(b, -1, self.dim), keys.transpose(1, 2)).mul_(self.dim**-0.5).relu_()
        scores = torch.bmm(w.reshape(-1, 1, self.heads), scores.view(-1, self.heads, pools)).view(b, -1, pools)
        pool_end = (torch.arange(pools, device=x.device) + 1) * self.kpool - 1
        complete = pool_end[None, None, :] <= query_pos[..., None]  # every token of the pool is visible
        scores = scores.masked_fill(~complete, float("-inf"))
        k = min(self.topk // self.kpool, pools)
        # scores tie exactly (at 0, every head's ReLU off) often with few heads: ties go to the earlier pool
        chosen = earliest_top_k(scores, k)
        chosen &= complete  # fewer complete pools than k: the rest of the top-k are not pools
        tokens = chosen.repeat_interleave(self.kpool, dim=-1)[..., :max_kv]
        j = torch.arange(max_kv, device=x.device)
        if self.always_tail:
            tail_start = query_pos - (query_pos + 1) % self.kpool + 1
            tokens |= (j >= tail_start[..., None]) & (j <= query_pos[..., None])
        return tokens
