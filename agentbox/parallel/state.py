"""Tensor-parallel process-group state. At tp=1 every collective is a no-op, so layers call them freely."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TPState:
    rank: int = 0
    size: int = 1


_state = TPState()


def set_tp_state(rank: int, size: int) -> None:
    global _state
    _state = TPState(rank, size)


def tp_rank() -> int:
    return _state.rank


def tp_size() -> int:
    return _state.size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _state.size == 1:
        return x
    torch.distributed.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    if _state.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_state.size)]
    torch.distributed.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)
