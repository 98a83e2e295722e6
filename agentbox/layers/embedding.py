"""Vocabulary-parallel embedding and LM head.

The vocabulary is split into equal contiguous ranges, one per rank (the last range padded with zero rows
when the vocab does not divide). The embedding masks ids outside its range and all-reduces; the head
computes its range's logits and all-gathers them along the vocab dim.

A GGUF table arrives as the file's blocks. On a CPU where kernels/cpu_gemv builds, Q8_0 and 4-bit tables
stay quantised (`QuantRows`): lookups dequantise only the rows asked for, and the LM head, which reads the
whole table every decode step (113 MB in fp32 for SmolLM2's 49152 x 576, 30 MB as Q8_0), runs the kernel.
On GPU the tables of every type the linear layers keep stay in those layers' form (`PackedRows`); other
types, and CPUs without the kernel, dequantise the blocks to the dense weight at load. An F16 or BF16 table of an
fp32 model on the CPU stays as stored (layers/quant/unquantized.py's rule): lookups widen the rows asked for, the head reads
it through kernels/cpu_f16.py (half the bytes a decode step streams).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from agentbox.kernels import cpu_f16
from agentbox.layers.quant.base import Sharding, quant_param
from agentbox.layers.quant.quant_rows import BitsRows, PackedRows, QuantRows, quant_rows
from agentbox.layers.quant.unquantized import keeps_f16
from agentbox.layers.weight_loading import ConvertsAfterLoading, set_weight_loader
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
        set_weight_loader(self.weight, self.weight_loader)
        self.quant: QuantRows | BitsRows | PackedRows | None = None  # the table kept quantised (GGUF), else None
        self.widen_rows = False  # an fp32 model's table kept 16-bit (weight_loader): lookups widen to fp32

    def weight_loader(self, param: nn.Parameter, loaded_weight: Any, shard_id: str | int | None = None) -> None:
        if tuple(loaded_weight.shape) != (self.num_embeddings, param.data.size(1)):
            raise ValueError(
                f"{type(self).__name__}: weight shape {tuple(loaded_weight.shape)} != "
                f"{(self.num_embeddings, param.data.size(1))}"
            )
        start = self.vocab_start_idx
        rows = max(0, min(self.num_embeddings, self.vocab_end_idx) - start)
        if not isinstance(loaded_weight, torch.Tensor):  # GGUF blocks
            self.quant = quant_rows(
                loaded_weight, start, rows, self.num_embeddings_per_partition, param.device, param.dtype
            )
            if isinstance(self.quant, PackedRows):  # a child module now: its tensors are the parameters
                self.weight = quant_param(param.data.new_empty(0), Sharding(None, None))
                return
            if isinstance(self.quant, BitsRows):
                self.weight = quant_param(self.quant.codes, Sharding(None, None))
                return
            if self.quant is not None:
                self.weight = quant_param(self.quant.codes, Sharding(None, None))
                self.quant_scale = quant_param(self.quant.scale, Sharding(None, None))
                return
            loaded_weight = loaded_weight.narrow((start, rows), None).dequantize()
            start = 0
        if self.tp_size == 1 and keeps_f16(param.data, loaded_weight):  # read as stored (kernels/cpu_f16.py)
            # An fp32 model's lookups widen the rows; a bf16 model's bf16 table is simply its dtype.
            self.widen_rows = param.dtype == torch.float32
            param.data = torch.empty(param.shape, dtype=loaded_weight.dtype)
        param.data.zero_()
        param.data[:rows].copy_(loaded_weight[start : start + rows])

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return self.quant.rows(ids)
        out = F.embedding(ids, self.weight)
        return out.float() if self.widen_rows else out

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._lookup(input_ids)
        in_range = (input_ids >= self.vocab_start_idx) & (input_ids < self.vocab_end_idx)
        local = torch.where(in_range, input_ids - self.vocab_start_idx, 0)
        out = self._lookup(local)
        return all_reduce(out * in_range.unsqueeze(-1).to(out.dtype))


class ParallelLMHead(VocabParallelEmbedding, ConvertsAfterLoading):
    """Hidden states -> logits over the full vocab. `tie_to(embedding)` shares the embedding's weight."""

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        if embedding.weight.shape != self.weight.shape:
            raise ValueError("cannot tie an LM head to an embedding of a different shape")
        self.weight = embedding.weight
        self.tied_to = embedding  # a table kept quantised is installed after this, at load

    def process_weights_after_loading(self) -> None:
        tied = getattr(self, "tied_to", None)
        if tied is not None and tied.quant is not None:
            self.weight = tied.weight  # share the quantised codes: the fp32 placeholder is dropped

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        quant = self.quant or getattr(getattr(self, "tied_to", None), "quant", None)
        if quant is not None:
            local = quant.matmul(hidden)
        elif self.weight.dtype in cpu_f16.HALF_DTYPES and hidden.dtype == torch.float32 and hidden.device.type == "cpu":
            local = cpu_f16.f16_matmul(hidden, self.weight)  # an f16 / bf16 table kept as it is stored
        else:
            local = F.linear(hidden, self.weight)
        logits = all_gather_last_dim(local)
        return logits[..., : self.num_embeddings] if self.tp_size > 1 else logits
