"""Tensor-parallel linear layers (nano-vllm style), each holding a linear method (`layers/quant/`).

Every parameter carries a `weight_loader(param, loaded_weight, shard_id=None)` that takes the full
checkpoint tensor and copies this rank's shard into place, so the model's loader never needs to know how a
layer is split. The layer computes the shard in logical [out, in] coordinates (`out_range`, `in_range`);
its method maps them onto whatever layout it stores (dense, packed int4, blocks, per-group scales).
Column-parallel layers split the output dim; row-parallel layers split the input dim and all-reduce their
partial sums inside forward, so the model file never calls a collective.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from agentbox.layers.quant.base import QuantLayer, Sharding, linear_method, quant_param
from agentbox.layers.quant.int4 import Int4Kernel
from agentbox.layers.weight_loading import set_weight_loader
from agentbox.parallel.state import all_reduce, head_shard, tp_rank, tp_size


def _divide(n: int, d: int, what: str) -> int:
    if n % d != 0:
        raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size ({d})")
    return n // d


class LinearBase(QuantLayer):
    # What an int4 method installed (layers/quant/int4.py), which the CPU fused decode reads
    # (engine/exec/cpu_decode.py): the kernel its weight is packed for, GPTQ act-order's column permutation.
    int4_kernel: Int4Kernel | None = None
    act_perm: nn.Parameter | None

    def __init__(self, input_size: int, output_size: int, bias: bool, tp_dim: int | None, prefix: str = "") -> None:
        super().__init__()
        self.tp_dim = tp_dim
        self.tp_rank = tp_rank()
        self.tp_size = tp_size()
        self.input_size, self.output_size = input_size, output_size  # this rank's
        self.prefix = prefix
        self.register_parameter("act_perm", None)
        self.quant_method = linear_method(prefix)
        self.quant_method.create_weights(self, input_size, output_size, torch.get_default_dtype())
        if bias:
            self.bias: nn.Parameter | None = quant_param(torch.empty(output_size), Sharding(0, None))
        else:
            self.register_parameter("bias", None)
        for p in self.parameters(recurse=False):
            set_weight_loader(p, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded_weight: Any, shard_id: str | int | None = None) -> None:
        name = next((n for n, p in self.named_parameters(recurse=False) if p is param), "weight")
        self.quant_method.load(self, param, loaded_weight, shard_id, name if shard_id is None else f"shard {shard_id}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False, prefix: str = "") -> None:
        super().__init__(input_size, output_size, bias, None, prefix)


class ColumnParallelLinear(LinearBase):
    """y = x W^T with W split by output rows; each rank returns its slice of the output features."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, prefix: str = "") -> None:
        super().__init__(input_size, _divide(output_size, tp_size(), "output size"), bias, 0, prefix)

    def out_range(self, shard_id: str | int | None) -> tuple[int, int, int]:
        return 0, self.tp_rank * self.output_size, self.output_size


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections stacked in one matmul (gate_up: shard ids 0 and 1)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, prefix: str = "") -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, prefix)

    def out_range(self, shard_id: str | int | None) -> tuple[int, int, int]:
        if not isinstance(shard_id, int):
            raise ValueError(f"MergedColumnParallelLinear needs an integer shard id, got {shard_id!r}")
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        return offset, self.tp_rank * size, size


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
        prefix: str = "",
    ) -> None:
        self.head_dim = head_dim
        self.shard = head_shard(total_num_heads, total_num_kv_heads)
        self.num_heads = self.shard.num_heads
        self.num_kv_heads = self.shard.num_kv_heads
        LinearBase.__init__(self, hidden_size, (self.num_heads + 2 * self.num_kv_heads) * head_dim, bias, 0, prefix)

    def out_range(self, shard_id: str | int | None) -> tuple[int, int, int]:
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
        return offset, start, size


class RowParallelLinear(LinearBase):
    """y = x W^T with W split by input columns; partial sums are all-reduced here. Bias added once.
    `input_shard` (start, size) overrides the even split (o_proj follows its rank's attention heads)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        prefix: str = "",
        input_shard: tuple[int, int] | None = None,
    ) -> None:
        self.input_start = None if input_shard is None else input_shard[0]
        local = _divide(input_size, tp_size(), "input size") if input_shard is None else input_shard[1]
        super().__init__(local, output_size, bias, 1, prefix)

    def in_range(self) -> tuple[int, int] | None:
        start = self.tp_rank * self.input_size if self.input_start is None else self.input_start
        return start, self.input_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.tp_rank == 0 else None
        return all_reduce(self.quant_method.apply(self, x, bias))
