"""The recurrent state of a hybrid model's linear-attention layers (Gated DeltaNet): one slot per sequence.

A linear layer keeps no per-token KV. What it carries from one step to the next is fixed-size: the last K-1
inputs of its short conv and the [Dk, Dv] state matrix of each value head. `StateCache` holds both for every
linear layer and every slot; the runner gives each running sequence a slot (its page-table row) and a step
tells the layers which slot each sequence reads and writes (`StateStep`, in the forward context).

A state describes exactly one position: the tokens a sequence has computed. It can never be resumed from
any other position, so a sequence whose first token is in the step (`fresh`) starts from zeros, and one
resumed elsewhere needs a snapshot taken at that exact position (`copy`: slot to slot, the same on every
tensor-parallel rank).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


class StateSpec(Protocol):
    """One layer's per-slot state: the tensors it allocates for every slot (slot is dim 0 of each)."""

    def bytes(self, dtype: torch.dtype) -> int: ...

    def allocate(self, num_slots: int, dtype: torch.dtype, device: torch.device | str) -> tuple[torch.Tensor, ...]: ...


@dataclass(frozen=True)
class LinearStateSpec:
    """One linear layer's state on this rank (its share of the heads)."""

    conv_channels: int  # q, k and v channels that go through the conv
    conv_len: int  # kernel size - 1: the inputs the conv carries over
    num_heads: int  # value heads
    key_dim: int
    value_dim: int

    def bytes(self, dtype: torch.dtype) -> int:
        conv = self.conv_channels * self.conv_len * torch.empty(0, dtype=dtype).element_size()
        return conv + self.num_heads * self.key_dim * self.value_dim * 4  # the matrix is fp32

    def allocate(self, num_slots: int, dtype: torch.dtype, device: torch.device | str) -> tuple[torch.Tensor, ...]:
        return (
            torch.zeros(num_slots, self.conv_channels, self.conv_len, dtype=dtype, device=device),
            torch.zeros(num_slots, self.num_heads, self.key_dim, self.value_dim, dtype=torch.float32, device=device),
        )


@dataclass(frozen=True)
class StateRecord:
    """One snapshot off the slots, as a host or disk tier keeps it: the state at position `num_tokens` of the
    tokens whose digest is `digest` (engine/cache/state_snapshots.digest), and its tensors, every state layer's
    in `StateCache.layers` order (a linear layer's conv, then its matrix), on any device."""

    num_tokens: int
    digest: bytes
    tensors: tuple[torch.Tensor, ...]


class StateCache:
    """Every state layer's tensors for every slot. `layers[i]` are layer i's tensors (a linear layer's conv and
    matrix, `conv[i]` and `matrix[i]`; a sliding-window layer's key and value rings, layers/window_kv.py).
    Slots [0, num_slots) are on the device; `num_host` more follow them in host RAM (pinned beside a GPU), for
    snapshots demoted there: a copy between the two is one slot index to another (`copy`)."""

    def __init__(self, specs: list[StateSpec], num_slots: int, dtype: torch.dtype, device: torch.device | str,
                 num_host: int = 0) -> None:
        self.specs = specs
        self.num_slots = num_slots
        self.num_host = num_host
        self.layers = [s.allocate(num_slots, dtype, device) for s in specs]
        self.conv = [t[0] for t in self.layers]
        self.matrix = [t[1] for t in self.layers]
        pin = torch.device(device).type == "cuda"
        self.host_layers = [tuple(t.pin_memory() if pin else t for t in s.allocate(num_host, dtype, "cpu"))
                            for s in specs] if num_host else []

    @staticmethod
    def bytes_per_slot(specs: list[StateSpec], dtype: torch.dtype) -> int:
        return sum(s.bytes(dtype) for s in specs)

    def slot_bytes(self) -> int:
        """Bytes one slot holds, from the tensors themselves."""
        return sum(t[0].numel() * t.element_size() for t in (*self.conv, *self.matrix))

    def _at(self, slot: int) -> list[tuple[tuple[torch.Tensor, ...], int]]:
        if slot < self.num_slots:
            return [(tensors, slot) for tensors in self.layers]
        return [(tensors, slot - self.num_slots) for tensors in self.host_layers]

    def copy(self, src: list[int], dst: list[int]) -> None:
        """State of slot src[i] into slot dst[i], every layer, in order: a later copy may read what an
        earlier one wrote (a snapshot saved, then a request seeded from it), so they are never batched."""
        for s, d in zip(src, dst, strict=True):
            for (ts, i), (td, j) in zip(self._at(s), self._at(d), strict=True):
                for a, b in zip(ts, td, strict=True):
                    b[j].copy_(a[i], non_blocking=False)

    def read(self, slot: int, num_tokens: int, digest: bytes) -> StateRecord:
        """Slot `slot` as a record (copies, on the slot's device)."""
        return StateRecord(num_tokens, digest, tuple(t[i].clone() for ts, i in self._at(slot) for t in ts))

    def write(self, slot: int, record: StateRecord) -> None:
        """A record back into slot `slot` (its tensors in `layers` order, as `read` made them)."""
        dst = [t[i] for ts, i in self._at(slot) for t in ts]
        if len(dst) != len(record.tensors):
            raise ValueError(f"a state record of {len(record.tensors)} tensors for a cache of {len(dst)}")
        for d, t in zip(dst, record.tensors, strict=True):
            d.copy_(t)


@dataclass
class StateStep:
    """A step's view of the state: each sequence's slot, new tokens, whether it starts at position 0, and the
    position of its first new token."""

    cache: StateCache
    slots: list[int]
    query_lens: list[int]
    fresh: list[bool]
    starts: list[int]

    @staticmethod
    def of(cache: StateCache, slots: list[int], query_lens: list[int], kv_lens: list[int]) -> StateStep:
        starts = [k - q for q, k in zip(query_lens, kv_lens, strict=True)]
        return StateStep(cache, slots, query_lens, [s == 0 for s in starts], starts)
