"""Tensor-parallel process-group state. At tp=1 every collective is a no-op, so layers call them freely.

At tp > 1 the layers' collectives and the start-up agreement (pool size, resident bytes) go over NCCL on
CUDA and over shared memory on CPU (parallel/shm_group.py: gloo's transport thread wakes every 10 ms, so
it is not used). Steps themselves do not cross a collective: rank 0 writes each step to the workers'
pipes (engine/exec/worker.py), so an idle worker sits in a blocking pipe read, not a spinning broadcast.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agentbox.parallel.shm_group import ShmGroup


@dataclass(frozen=True)
class TPState:
    rank: int = 0
    size: int = 1


_state = TPState()
_shm: ShmGroup | None = None  # the CPU group at tp > 1 (else torch.distributed's default group)
_device = torch.device("cpu")  # where control tensors live (NCCL takes only device tensors)


def set_tp_state(rank: int, size: int) -> None:
    global _state
    _state = TPState(rank, size)


def tp_rank() -> int:
    return _state.rank


def tp_size() -> int:
    return _state.size


def init_distributed(
    rank: int, size: int, port: int, device: torch.device, shm: ShmGroup | None = None, timeout_s: float = 600.0
) -> None:
    """Joins the tp group (rank 0 and every worker call it with the same port) and sets the tp state. On CPU
    the group is `shm` (made by rank 0 before it spawned the workers); on CUDA it is NCCL over `port`.
    timeout_s bounds every NCCL collective: a step on a live group takes milliseconds, loading minutes."""
    global _shm, _device
    from datetime import timedelta

    import torch.distributed as dist

    set_tp_state(rank, size)
    _device = device
    if size == 1:
        return
    if device.type == "cpu":
        if shm is None:
            raise ValueError("tensor parallel on CPU needs the shared-memory group rank 0 made")
        _shm = shm.for_rank(rank)
        return
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size, timeout=timedelta(seconds=timeout_s)
    )


def destroy_distributed() -> None:
    global _shm
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    _shm = None
    set_tp_state(0, 1)


def control_all_gather(value: int) -> list[int]:
    """Every rank's `value`, in rank order ([value] at tp 1)."""
    if _state.size == 1:
        return [value]
    mine = torch.tensor([value], dtype=torch.int64, device=_device)
    if _shm is not None:
        return [int(p.item()) for p in _shm.all_gather(mine)]
    parts = [torch.zeros_like(mine) for _ in range(_state.size)]
    torch.distributed.all_gather(parts, mine)
    return [int(p.item()) for p in parts]


def shard_range(n: int, size: int, rank: int) -> tuple[int, int]:
    """(start, count) of rank's contiguous share of n items; earlier ranks take one more when n % size."""
    base, extra = divmod(n, size)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


@dataclass(frozen=True)
class HeadShard:
    q_start: int
    num_heads: int
    kv_start: int
    num_kv_heads: int


def head_shard(total_heads: int, total_kv_heads: int, size: int | None = None, rank: int | None = None) -> HeadShard:
    """This rank's attention heads. KV heads are split whole (unevenly when they do not divide: SmolLM2's
    3 KV heads at tp 2 become 2 + 1) and each rank takes the query heads of its KV groups; with fewer KV
    heads than ranks each KV head is replicated on tp / kv ranks and the query heads split evenly."""
    size = _state.size if size is None else size
    rank = _state.rank if rank is None else rank
    group = total_heads // total_kv_heads
    if total_kv_heads >= size:
        kv_start, kv_count = shard_range(total_kv_heads, size, rank)
        return HeadShard(kv_start * group, kv_count * group, kv_start, kv_count)
    if size % total_kv_heads or total_heads % size:
        raise ValueError(
            f"{total_heads} attention heads with {total_kv_heads} key/value heads cannot be split over "
            f"{size} tensor-parallel ranks"
        )
    per_rank = total_heads // size
    return HeadShard(rank * per_rank, per_rank, rank // (size // total_kv_heads), 1)


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _state.size == 1:
        return x
    if _shm is not None:
        return _shm.all_reduce(x)
    torch.distributed.all_reduce(x)  # NCCL, or a group a test made itself
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    if _state.size == 1:
        return x
    if _shm is not None:
        return torch.cat(_shm.all_gather(x), dim=-1)
    parts = [torch.empty_like(x) for _ in range(_state.size)]
    torch.distributed.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)
