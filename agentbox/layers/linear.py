"""Tensor-parallel linear layers (nano-vllm style).

Every parameter carries a `weight_loader(param, loaded_weight, shard_id=None)` that takes the full
Hugging Face tensor and copies this rank's shard into place, so the model's loader never needs to know
how a layer is split. Column-parallel layers split the output dim; row-parallel layers split the input dim
and all-reduce their partial sums inside forward, so the model file never calls a collective.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import nn

from agentbox.parallel.state import all_reduce, head_shard, tp_rank, tp_size


def _divide(n: int, d: int, what: str) -> int:
    if n % d != 0:
        raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size ({d})")
    return n // d


class LinearBase(nn.Module, ABC):
    def __init__(self, input_size: int, output_size: int, bias: bool, tp_dim: int | None) -> None:
        super().__init__()
        self.tp_dim = tp_dim
        self.tp_rank = tp_rank()
        self.tp_size = tp_size()
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        if bias:
            self.bias: nn.Parameter | None = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)

    @abstractmethod
    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        """Copy this rank's shard of a checkpoint tensor into `param` (each layer shards its own way)."""

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
        if dst.shape != src.shape:
            raise ValueError(
                f"{type(self).__name__}: {name} shard shape {tuple(src.shape)} != {tuple(dst.shape)}"
            )
        dst.copy_(src)


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, output_size, bias, None)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        self._copy(param.data, loaded_weight, "weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ColumnParallelLinear(LinearBase):
    """y = x W^T with W split by output rows; each rank returns its slice of the output features."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, _divide(output_size, tp_size(), "output size"), bias, 0)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        size = param.data.size(0)
        self._copy(param.data, loaded_weight.narrow(0, self.tp_rank * size, size), "weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections stacked in one matmul (gate_up: shard ids 0 and 1)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        if not isinstance(shard_id, int):
            raise ValueError(f"MergedColumnParallelLinear needs an integer shard id, got {shard_id!r}")
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        dst = param.data.narrow(0, offset, size)
        self._copy(dst, loaded_weight.narrow(0, self.tp_rank * size, size), f"shard {shard_id}")


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul; each rank holds the heads `parallel.state.head_shard` gives
    it (whole KV groups, unevenly when the KV heads do not divide the tp size)."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
    ) -> None:
        self.head_dim = head_dim
        self.shard = head_shard(total_num_heads, total_num_kv_heads)
        self.num_heads = self.shard.num_heads
        self.num_kv_heads = self.shard.num_kv_heads
        LinearBase.__init__(self, hidden_size, (self.num_heads + 2 * self.num_kv_heads) * head_dim, bias, 0)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        d, sh = self.head_dim, self.shard
        q_size, kv_size = sh.num_heads * d, sh.num_kv_heads * d
        if shard_id == "q":
            offset, size, start = 0, q_size, sh.q_start * d
        elif shard_id == "k":
            offset, size, start = q_size, kv_size, sh.kv_start * d
        elif shard_id == "v":
            offset, size, start = q_size + kv_size, kv_size, sh.kv_start * d
        else:
            raise ValueError(f"QKVParallelLinear shard id must be 'q', 'k' or 'v', got {shard_id!r}")
        dst = param.data.narrow(0, offset, size)
        self._copy(dst, loaded_weight.narrow(0, start, size), f"shard {shard_id}")


class RowParallelLinear(LinearBase):
    """y = x W^T with W split by input columns; partial sums are all-reduced here. Bias added once.
    `input_shard` (start, size) overrides the even split (o_proj follows its rank's attention heads)."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False, input_shard: tuple[int, int] | None = None
    ) -> None:
        self.input_start = None if input_shard is None else input_shard[0]
        local = _divide(input_size, tp_size(), "input size") if input_shard is None else input_shard[1]
        super().__init__(local, output_size, bias, 1)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        if param.data.dim() == 1:  # bias: replicated, only rank 0 adds it
            self._copy(param.data, loaded_weight, "bias")
            return
        size = param.data.size(1)
        start = self.tp_rank * size if self.input_start is None else self.input_start
        self._copy(param.data, loaded_weight.narrow(1, start, size), "weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.tp_rank == 0 else None
        return all_reduce(F.linear(x, self.weight, bias))
