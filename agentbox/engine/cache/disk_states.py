"""State snapshots on the disk tier: a hybrid (Gated DeltaNet) or Gemma 4 session survives a restart.

Pages alone cannot resume such a model: its per-sequence state resumes only at the exact position it was
saved (state_snapshots.py). So its snapshots go to the same disk tier as its pages, the same way:
- Named by the chained hash of the page their position ends on (the position is page-aligned), so a
  snapshot is only ever found by a sequence that starts with the very tokens it describes; checksummed and
  indexed like pages (disk_tier.py); the namespace covers the state's layout (disk_namespace.py).
- Written when a turn ends (`write_behind`, on the tier's writer thread), when they leave memory (a snapshot
  the store drops for room: `dropping`, before its slot is reused), and every held snapshot at a graceful stop
  (`persist`). A slot whose copy is still queued for
  the next step does not hold its snapshot yet: it is not written (recomputed later, never served wrong).
- Restored on a match: when the disk holds a snapshot further into the prompt than any in memory, the lookup
  names it (`find`, pure) and the lock reads it into a store slot (`load`, under its own key, `disk:<hash>`)
  for the request to seed from; the cache keeps the match's disk pages up to that position, and falls back
  to computing from the start when the pages come back short (a torn chunk, no room), since the state would
  then be at the wrong place (state_group.py, manager.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from agentbox.engine.cache.disk_tier import DiskTier
from agentbox.engine.cache.state_snapshots import Snapshot, SnapshotStore
from agentbox.layers.recurrent_state import StateCache, StateRecord


@dataclass(frozen=True)
class DiskSnapshot:
    """A snapshot on disk a lookup found (`DiskStates.find`): the state after `tokens`."""

    hash: bytes
    tokens: tuple[int, ...]

    @property
    def key(self) -> str:
        return "disk:" + self.hash.hex()

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


def slot_bytes(state: StateCache, slot: int) -> bytes:
    """Every state tensor's slot (device or host), in `state.layers` order, bit-exact."""
    return b"".join(t.reshape(-1).cpu().view(torch.uint8).numpy().tobytes() for t in state.read(slot, 0, b"").tensors)


def bytes_to_slot(state: StateCache, slot: int, data: bytes) -> bool:
    """Write data (as slot_bytes made it) into `slot`; False (nothing written) when its size does not fit."""
    like = state.read(slot, 0, b"").tensors
    sizes = [t.numel() * t.element_size() for t in like]
    if sum(sizes) != len(data):
        return False
    parts, off = [], 0
    for t, n in zip(like, sizes, strict=True):
        parts.append(torch.frombuffer(bytearray(data[off : off + n]), dtype=torch.uint8).view(t.dtype).view(t.shape))
        off += n
    state.write(slot, StateRecord(0, b"", tuple(parts)))
    return True


class DiskStates:
    """The snapshot store's disk side (its `listener`)."""

    def __init__(self, tier: DiskTier, state: StateCache, store: SnapshotStore, page_size: int,
                 pending: Callable[[], set[int]]) -> None:
        self.tier = tier
        self.state = state
        self.store = store
        self.ps = page_size
        self.pending = pending  # slots a queued copy will fill at the next step (their content is not theirs yet)
        self._tokens: dict[int, Sequence[int]] = {}  # slot -> the tokens its snapshot describes
        self.written = 0  # snapshots written (or queued to be, at turn ends)
        self.restored = 0
        store.listener = self

    # ---- the store's hooks ----

    def saved(self, slot: int, tokens: Sequence[int]) -> None:
        self._tokens[slot] = tokens

    def moved(self, src: int, dst: int) -> None:
        toks = self._tokens.pop(src, None)
        if toks is not None:
            self._tokens[dst] = toks

    def dropping(self, slot: int) -> None:
        if slot not in self.pending():
            self._write(slot)
        self._tokens.pop(slot, None)

    # ---- write ----

    def _write(self, slot: int) -> bool:
        toks = self._tokens.get(slot)
        if not toks or len(toks) % self.ps:
            return False
        h = self.tier.hashes(tuple(toks), self.ps, len(toks) // self.ps)[-1]
        if self.tier.has_state(h):
            return False
        ok = self.tier.write_state(h, slot_bytes(self.state, slot))
        self.written += ok
        return ok

    def write_behind(self, tokens: Sequence[int], src: int) -> bool:
        """A turn's snapshot, the state in slot `src` (the row's page-aligned copy, at exactly the end of tokens),
        queued for the tier's writer thread (read from src now: the store's own copy runs at the next step)."""
        if not tokens or len(tokens) % self.ps:
            return False
        h = self.tier.hashes(tuple(tokens), self.ps, len(tokens) // self.ps)[-1]
        ok = not self.tier.has_state(h) and self.tier.write_state_behind(h, slot_bytes(self.state, src))
        self.written += ok
        return ok

    def persist(self, copies: list[tuple[int, int]]) -> int:
        """A graceful stop: every snapshot held, after the queued `copies` (src, dst) that fill the slots of the
        turns that just ended (there is no next step to run them). Returns the snapshots written."""
        self.state.copy([s for s, _ in copies], [d for _, d in copies])
        n = 0
        for snap in self.store.snapshots():
            toks = self._tokens.get(snap.slot)
            if toks is not None and len(toks) == snap.num_tokens:
                n += self._write(snap.slot)
        self.tier.save_index()
        return n

    # ---- restore ----

    def find(self, snap: Snapshot | None, tokens: Sequence[int], limit: int) -> Snapshot | DiskSnapshot | None:
        """A snapshot further into `tokens` (up to `limit`) than `snap` (the best one in memory): one read back
        from disk before (an admission that then had to wait), or one still on disk. None when there is none.
        Pure."""
        have = snap.num_tokens if snap is not None else 0
        if not self.tier.states or limit < have + self.ps:
            return None
        toks = tuple(tokens[: limit // self.ps * self.ps])
        hs = self.tier.hashes(toks, self.ps, len(toks) // self.ps)
        k = next((k for k in range(len(hs), have // self.ps, -1) if self.tier.has_state(hs[k - 1])), 0)
        if not k:
            return None
        found = DiskSnapshot(hs[k - 1], toks[: k * self.ps])
        return self.store.find(found.key, toks, limit) or found

    def load(self, found: DiskSnapshot, tokens: Sequence[int], seeds: set[int]) -> Snapshot | None:
        """`found` read into a store slot; None when it cannot be (unreadable, no slot). `seeds`: slots requests
        admitted this step seed from (never overwritten). The store's queued copies run here first (between
        steps, on the one rank a disk tier runs on): taking a slot may demote its victim, a copy that reads the
        slot before the disk's bytes land in it."""
        data = self.tier.read_state(found.hash)
        if data is None:
            return None
        slot = self.store.adopt(found.key, found.tokens)
        if slot is None:
            return None
        copies = self.store.take_copies()
        self.state.copy([s for s, _ in copies], [d for _, d in copies])
        if slot in seeds or not bytes_to_slot(self.state, slot, data):
            self.store.drop(found.key)
            return None
        self.restored += 1
        return self.store.find(found.key, tokens, found.num_tokens)


def disk_states(tier: DiskTier | None, state: StateCache | None, store: SnapshotStore | None,
                page_size: int) -> DiskStates | None:
    """The engine's snapshots on its disk tier, or None (no disk tier, no state, no snapshots kept)."""
    if tier is None or state is None or store is None:
        return None
    return DiskStates(tier, state, store, page_size, store.pending_slots)
