"""Vocabulary-parallel embedding and LM head.

The vocabulary is split into equal contiguous ranges, one per rank (the last range padded with zero rows
when the vocab does not divide). The embedding masks ids outside its range and all-reduces; the head
computes its range's logits and all-gathers them along the vocab dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from agentbox.parallel.state import all_gather_last_dim, all_reduce, tp_rank, tp_size


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp_rank = tp_rank()
        self.tp_size = tp_size()
        self.num_embeddings = num_embeddings
        self.num_embeddings_per_partition = -(-num_embeddings // self.tp_size)
        self.vocab_start_idx = self.num_embeddings_per_partition * self.tp_rank
        self.vocab_end_idx = self.vocab_start_idx + self.num_embeddings_per_partition
        self.weight = nn.Parameter(
            torch.empty(self.num_embeddings_per_partition, embedding_dim), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        if loaded_weight.shape != (self.num_embeddings, param.data.size(1)):
            raise ValueError(
                f"{type(self).__name__}: weight shape {tuple(loaded_weight.shape)} != "
                f"{(self.num_embeddings, param.data.size(1))}"
            )
        start = self.vocab_start_idx
        rows = max(0, min(self.num_embeddings, self.vocab_end_idx) - start)
        param.data.zero_()
        param.data[:rows].copy_(loaded_weight[start : start + rows])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        in_range = (input_ids >= self.vocab_start_idx) & (input_ids < self.vocab_end_idx)
        local = torch.where(in_range, input_ids - self.vocab_start_idx, 0)
        out = F.embedding(local, self.weight) * in_range.unsqueeze(-1).to(self.weight.dtype)
        return all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Hidden states -> logits over the full vocab. `tie_to(embedding)` shares the embedding's weight."""

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        if embedding.weight.shape != self.weight.shape:
            raise ValueError("cannot tie an LM head to an embedding of a different shape")
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        logits = all_gather_last_dim(F.linear(hidden, self.weight))
        return logits[..., : self.num_embeddings] if self.tp_size > 1 else logits
