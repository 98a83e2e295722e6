"""The recurrent state of a hybrid model's linear-attention layers (Gated DeltaNet): one slot per sequence.

A linear layer keeps no per-token KV. What it carries from one step to the next is fixed-size: the last K-1
inputs of its short conv and the [Dk, Dv] state matrix of each value head. `StateCache` holds both for every
linear layer and every slot; the runner gives each running sequence a slot (its page-table row) and a step
tells the layers which slot each sequence reads and writes (`StateStep`, in the forward context).

A state describes exactly one position: the tokens a sequence has computed. It can never be resumed from
any other position, so a sequence whose first token is in the step (`fresh`) starts from zeros, and one
resumed elsewhere needs a snapshot taken at that exact position (`copy`: slot to slot, the same on every
tensor-parallel rank).

A speculative verify (engine/exec/verify.py) scores a sequence's next token and k draft tokens in one step, and
only after sampling is it known how many of them the sequence keeps. So a verified (`pending`) sequence's layers
read their slot but leave it as it was, and keep what each of the step's positions would add (`stash`: a linear
layer's conv inputs, k, v, g and beta; a window layer's k and v); the next step's `commit` adds the kept
positions' part to the slot. The recompute is the state's own update only (a rank-one update per token and
head, no projection), measured against keeping every position's state in docs/speculative.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from agentbox.layers import delta_rule


class StateSpec(Protocol):
    """One layer's per-slot state: the tensors it allocates for every slot (slot is dim 0 of each)."""

    def bytes(self, dtype: torch.dtype) -> int: ...

    def allocate(self, num_slots: int, dtype: torch.dtype, device: torch.device | str) -> tuple[torch.Tensor, ...]: ...

    def commit(self, tensors: tuple[torch.Tensor, ...], slot: int, stash: tuple, lo: int, hi: int) -> None:
        """Adds positions [lo, hi) of a verify's stash (relative to its first new token) to the slot."""
        ...


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

    def commit(self, tensors: tuple[torch.Tensor, ...], slot: int, stash: tuple, lo: int, hi: int) -> None:
        """stash: the verify's conv inputs x [C, n], prepared k [H, n, Dk], v [H, n, Dv], g, beta [H, n], and its
        final matrix and conv state (a draft kept whole: no recompute)."""
        conv, matrix = tensors
        x, k, v, g, beta, last, conv_last = stash
        if lo == 0 and hi == x.shape[-1]:
            conv[slot], matrix[slot] = conv_last, last
            return
        conv[slot] = torch.cat([conv[slot].to(x.dtype), x[:, lo:hi]], dim=-1)[:, -self.conv_len :]
        sel = slice(lo, hi)
        _, matrix[slot] = delta_rule.recurrent(  # q is unused for the state: k stands in
            k[None, :, sel], k[None, :, sel], v[None, :, sel], g[None, :, sel], beta[None, :, sel], matrix[slot][None]
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
    """Every state layer's tensors for every slot. `layers[i]` are layer i's tensors, as many as its spec
    allocates (a linear layer's conv and matrix, `conv[i]` and `matrix[i]`; a sliding-window layer's key and
    value rings, layers/window_kv.py).
    Slots [0, num_slots) are on the device; `num_host` more follow them in host RAM (pinned beside a GPU): the
    snapshots that do not fit on a small card (a Gemma 4 31B ring is 812 MiB) and those demoted there. A copy
    between the two is one slot index to another (`copy`); the layers read device slots only."""

    def __init__(self, specs: list[StateSpec], num_slots: int, dtype: torch.dtype, device: torch.device | str,
                 num_host: int = 0) -> None:
        self.specs = specs
        self.num_slots = num_slots
        self.num_host = num_host
        self.layers = [s.allocate(num_slots, dtype, device) for s in specs]
        # (layer, slot) -> a pending verify's per-position inputs, until the next step's `commit`
        self.stash: dict[tuple[int, int], tuple] = {}
        pin = torch.device(device).type == "cuda"
        self.host_layers = [tuple(t.pin_memory() if pin else t for t in s.allocate(num_host, dtype, "cpu"))
                            for s in specs] if num_host else []

    @staticmethod
    def bytes_per_slot(specs: list[StateSpec], dtype: torch.dtype) -> int:
        return sum(s.bytes(dtype) for s in specs)

    @property
    def conv(self) -> list[torch.Tensor]:
        """Each layer's first tensor (a linear layer's conv inputs)."""
        return [t[0] for t in self.layers]

    @property
    def matrix(self) -> list[torch.Tensor]:
        """Each layer's second tensor (a linear layer's state matrix)."""
        return [t[1] for t in self.layers]

    def slot_bytes(self) -> int:
        """Bytes one slot holds, from the tensors themselves (every tensor of every layer: a spec allocates as
        many as it needs)."""
        return sum(t[0].numel() * t.element_size() for ts in self.layers for t in ts)

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

    def commit(self, commits: list[tuple[int, int, int]], aligned_offset: int | None) -> None:
        """Each (slot, kept, aligned) of the last step's verifies: its first `kept` positions into the slot; when
        `aligned` > 0 the state after that many of them (a page boundary) is first copied to the slot's
        page-aligned copy, `aligned_offset` further (None: the slot is its own page-aligned copy, a ring with a
        page of slack). kept = 0 drops the stash (the sequence has ended)."""
        for slot, kept, aligned in commits:
            aligned = 0 if aligned_offset is None else aligned
            parts = [(0, aligned), (aligned, kept)] if 0 < aligned < kept else [(0, kept)]
            for lo, hi in parts:
                for i, spec in enumerate(self.specs):
                    if hi > lo:
                        spec.commit(self.layers[i], slot, self.stash[i, slot], lo, hi)
                if aligned and hi == aligned:
                    self.copy([slot], [slot + (aligned_offset or 0)])
            for i in range(len(self.specs)):
                self.stash.pop((i, slot), None)


@dataclass
class StateStep:
    """A step's view of the state: each sequence's slot, new tokens, whether it starts at position 0, the
    position of its first new token, and whether it is a verify whose slot waits for the next step's commit."""

    cache: StateCache
    slots: list[int]
    query_lens: list[int]
    fresh: list[bool]
    starts: list[int]
    pending: list[bool]

    @staticmethod
    def of(cache: StateCache, slots: list[int], query_lens: list[int], kv_lens: list[int],
           verifies: frozenset[int] = frozenset()) -> StateStep:
        starts = [k - q for q, k in zip(query_lens, kv_lens, strict=True)]
        return StateStep(cache, slots, query_lens, [s == 0 for s in starts], starts,
                         [i in verifies for i in range(len(slots))])

    def keep(self, layer: int, i: int, stash: tuple) -> None:
        """Sequence i is a verify: layer's per-position inputs wait for the commit."""
        self.cache.stash[layer, self.slots[i]] = stash
