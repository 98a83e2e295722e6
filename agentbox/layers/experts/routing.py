"""Routing: which experts each token goes to, with what weight."""

from __future__ import annotations

import torch


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing: (weights [T, k] float32, expert ids [T, k] int64).

    With renormalize the k weights sum to one, which is also gpt-oss's top-k-then-softmax (the same
    numbers: softmax over the top logits = the top softmax probabilities renormalised)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids
