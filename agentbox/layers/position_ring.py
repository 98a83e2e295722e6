"""Per-sequence state kept by position: a ring of the last `size` positions' values, position p at index
p % size (DeepSeek-V4's sliding K=V window, and the raw projections a compressed entry pools before it is
complete). It is a state spec (layers/recurrent_state.py): the engine gives it a slot per running sequence and
keeps snapshots of it at turn ends; a ring computed to position c describes exactly the positions [c - size, c).

Unlike a delta-net state, a ring is updated by overwriting positions, never by accumulating: a verify's kept
positions are just written (`commit`), in any split, and the write of a step's positions is the same code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agentbox.layers.recurrent_state import StateStep


@dataclass(frozen=True)
class RingSpec:
    """`size` positions, each holding one row per tensor of `widths` values."""

    size: int
    widths: tuple[int, ...]

    def bytes(self, dtype: torch.dtype) -> int:
        return self.size * sum(self.widths) * torch.empty(0, dtype=dtype).element_size()

    def allocate(self, num_slots: int, dtype: torch.dtype, device: torch.device | str) -> tuple[torch.Tensor, ...]:
        return tuple(torch.zeros(num_slots, self.size, w, dtype=dtype, device=device) for w in self.widths)

    def commit(self, tensors: tuple[torch.Tensor, ...], slot: int, stash: tuple, lo: int, hi: int) -> None:
        """stash: a verify's first position and its per-position values [n, width] per tensor; positions [lo, hi)
        of them into the ring."""
        start, *values = stash
        write(tensors, slot, start, values, lo, hi)


def write(tensors: tuple[torch.Tensor, ...], slot: int, start: int, values: list[torch.Tensor], lo: int = 0,
          hi: int | None = None) -> None:
    """Rows [lo, hi) of `values` (the positions start + lo ..) into the ring; only the last `size` win."""
    size = tensors[0].shape[1]
    hi = values[0].shape[0] if hi is None else hi
    kept = torch.arange(max(lo, hi - size), hi, device=values[0].device)
    for ring, v in zip(tensors, values, strict=True):
        ring[slot, (start + kept) % size] = v[kept].to(ring.dtype)


def before(ring: torch.Tensor, slot: int, start: int, count: int) -> torch.Tensor:
    """The ring's rows of positions [max(0, start - count), start), oldest first (count <= the ring's size)."""
    kept = torch.arange(max(0, start - count), start, device=ring.device)
    return ring[slot, kept % ring.shape[1]]


def update(step: StateStep, state_index: int, i: int, values: list[torch.Tensor]) -> None:
    """After sequence i's read: its step's positions go into the ring, or, for a verify, wait for the commit
    (the sampler decides how many of them are kept)."""
    if step.pending[i]:
        step.keep(state_index, i, (step.starts[i], *values))
        return
    write(step.cache.layers[state_index], step.slots[i], step.starts[i], values)
