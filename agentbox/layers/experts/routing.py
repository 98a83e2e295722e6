"""Routing: which experts each token goes to, with what weight."""

from __future__ import annotations

from enum import Enum

import torch
import torch.nn.functional as F


class Scoring(Enum):
    """How a router turns its logits into expert scores (transformers' `scoring_func`)."""

    SQRT_SOFTPLUS = "sqrtsoftplus"  # DeepSeek-V4
    SOFTMAX = "softmax"
    SIGMOID = "sigmoid"

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        if self is Scoring.SQRT_SOFTPLUS:
            return F.softplus(logits).sqrt()
        return logits.softmax(dim=-1) if self is Scoring.SOFTMAX else logits.sigmoid()


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing: (weights [T, k] float32, expert ids [T, k] int64).

    With renormalize the k weights sum to one, which is also gpt-oss's top-k-then-softmax (the same
    numbers: softmax over the top logits = the top softmax probabilities renormalised)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def select_experts_grouped(
    router_logits: torch.Tensor,
    top_k: int,
    correction_bias: torch.Tensor,
    n_group: int,
    topk_group: int,
    renormalize: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's "noaux_tc" routing (GLM-4.5/4.7): sigmoid scores; the per-expert correction bias only
    chooses (it is trained to balance load, never weights an output); the experts are first narrowed to the
    `topk_group` groups whose best two biased scores sum highest, then the top k of those are taken; their
    unbiased scores, renormalised when asked, times `scaling`, are the weights."""
    scores = router_logits.float().sigmoid()
    choice = scores + correction_bias.float()
    t, e = choice.shape
    if n_group > 1:
        group_scores = choice.view(t, n_group, e // n_group).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
        expert_mask = group_mask.unsqueeze(-1).expand(t, n_group, e // n_group).reshape(t, e)
        choice = choice.masked_fill(expert_mask == 0, float("-inf"))
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def weigh_chosen(scores: torch.Tensor, ids: torch.Tensor, scaling: float) -> torch.Tensor:
    """The chosen experts' scores, renormalised to sum to one and times `scaling` (DeepSeek-V4, for its learned
    and its hashed choices alike): float32 [T, k]."""
    weights = scores.gather(1, ids).float()
    return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * scaling
