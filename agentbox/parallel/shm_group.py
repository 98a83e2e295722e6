"""Collectives for tensor parallel on CPU, over shared memory instead of gloo.

Why not gloo: its TCP transport keeps a thread in every rank that wakes every 10 ms (`epoll_wait` with a
10 ms timeout, seen with strace on an idle server), so an idle tp-2 tree on CPU spent about 1 % of a core
in those two threads alone, against a target of under 1 % for the whole tree. Here the ranks meet at a
multiprocessing Barrier (semaphores: a waiting rank sleeps in the kernel) and trade data through one
shared buffer with a slot per rank; between collectives nothing runs at all.

One collective, chunk by chunk (a slot holds SLOT_BYTES by default): every rank copies its chunk into its own slot,
waits for the others, reads every slot (sums in rank order, so every rank gets bit-identical results),
and waits again before any slot may be overwritten by the next chunk or collective.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from multiprocessing.context import BaseContext
from typing import Any

import torch

SLOT_BYTES = 8 << 20  # per rank; larger tensors go through in chunks
BARRIER_TIMEOUT_S = 600.0  # start-up waits for the slowest rank's load; a step takes milliseconds


@dataclass(frozen=True)
class ShmGroup:
    """Picklable to spawned ranks: torch shares the buffer's storage, multiprocessing the barrier."""

    buffer: torch.Tensor  # uint8 [size, SLOT_BYTES] in shared memory
    barrier: Any  # multiprocessing.synchronize.Barrier for `size` parties
    size: int
    rank: int = 0

    @classmethod
    def create(cls, size: int, ctx: BaseContext, slot_bytes: int = SLOT_BYTES) -> ShmGroup:
        buffer = torch.zeros(size, slot_bytes, dtype=torch.uint8).share_memory_()
        return cls(buffer, ctx.Barrier(size), size)

    def for_rank(self, rank: int) -> ShmGroup:
        return replace(self, rank=rank)

    def _wait(self) -> None:
        self.barrier.wait(BARRIER_TIMEOUT_S)

    def _chunks(self, flat: torch.Tensor) -> Iterator[tuple[int, int]]:
        per = self.buffer.shape[1] // flat.element_size()
        for start in range(0, flat.numel(), per):
            yield start, min(per, flat.numel() - start)

    def _slot(self, rank: int, dtype: torch.dtype, n: int) -> torch.Tensor:
        return self.buffer[rank].view(dtype)[:n]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (x keeps its identity, as torch.distributed.all_reduce does)."""
        flat = x.contiguous().view(-1)
        for start, n in self._chunks(flat):
            part = flat[start : start + n]
            self._slot(self.rank, x.dtype, n).copy_(part)
            self._wait()
            part.copy_(self._slot(0, x.dtype, n))
            for r in range(1, self.size):
                part.add_(self._slot(r, x.dtype, n))
            self._wait()
        if flat.data_ptr() != x.data_ptr():
            x.copy_(flat.view_as(x))
        return x

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's x (same shape and dtype on every rank), in rank order."""
        flat = x.contiguous().view(-1)
        parts = [torch.empty_like(flat) for _ in range(self.size)]
        for start, n in self._chunks(flat):
            self._slot(self.rank, x.dtype, n).copy_(flat[start : start + n])
            self._wait()
            for r in range(self.size):
                parts[r][start : start + n].copy_(self._slot(r, x.dtype, n))
            self._wait()
        return [p.view_as(x) for p in parts]
