"""Recurrent-state snapshots of hybrid models, two per session: the state at the end of its last turn and
at the end of that turn's prompt.

A Gated DeltaNet layer's state resumes only at the exact position it was saved, so a cached prefix is
usable only up to a position some snapshot describes. An agent turn is append-only (turn N+1 starts with
everything turn N ended with), so one snapshot per session, taken when a turn ends, is what its next turn
needs: the KV pages of the attention layers up to that position come from the radix cache as usual.

Positions are page-aligned, like the pages the cache keeps: every running sequence has a second slot that
holds its state at the last page boundary a step ended on (engine/exec/runner.py copies it there; the
scheduler ends prefill chunks on page boundaries so the prompt's last one is such a step end). When the
turn ends, that state goes to the session's snapshot slot, with the tokens it covers (checked on lookup:
a session id is a claim, the tokens are the proof). The prompt's snapshot is the fallback when the next
turn does not reproduce the answer's tokens exactly (a chat template that re-renders the answer, a client
that edits it): the history up to the last prompt is still resumed.

Shared prefixes: a new session's first turn usually repeats a prefix another session sent (the agent's system
prompt and tool definitions). When the radix cache knows a longer prefix than any snapshot can resume (`match`
found pages up to position L, the divergence point with the sessions it knows), the request ends a chunk at L
and that state is kept as a SHARED snapshot, keyed by the digest of tokens [0, L) instead of a session: the
next session that sends the same L tokens resumes there. What it covers: positions where a radix match ended
for some request (page-aligned, as pages are); the first session to reach a divergence point pays for it
once, later ones do not. It does not cover a prefix only ever sent once (no request found it in the tree).

Slots: [0, rows) live state of running sequences, [rows, 2 rows) their page-aligned copies, then the
snapshots. A full store drops the least recently used session's snapshot (idle sessions before the ones
that just ran), shared-prefix snapshots first; the session then recomputes its history once, never resumes
from a wrong position.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

import numpy as np


def _digest(tokens: Sequence[int]) -> bytes:
    return hashlib.blake2b(np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=16).digest()


class SnapshotPoint(Enum):
    TURN = "turn"  # the end of a turn: prompt and answer
    PROMPT = "prompt"  # the end of its prompt
    SHARED = "shared"  # a prefix several sessions sent (keyed by its tokens' digest, not by a session)


@dataclass(frozen=True)
class SnapshotStats:
    """What the store holds (/v1/stats `snapshots`). Bytes are this rank's: slots x the real size of one slot
    of the state cache's tensors (at tensor parallel size N each rank holds 1/N of the heads)."""

    count: int
    capacity: int
    slot_bytes: int
    used_bytes: int
    capacity_bytes: int
    saved: int
    hits: int
    dropped: int


@dataclass(frozen=True)
class Snapshot:
    slot: int
    num_tokens: int  # the position the state describes (page-aligned)
    digest: bytes  # of the tokens [0, num_tokens)


class SnapshotListener(Protocol):
    """Told when a slot gets a new snapshot and when one is about to leave memory (the disk tier's hook:
    disk_states.py)."""

    def saved(self, slot: int, tokens: Sequence[int]) -> None: ...

    def dropping(self, slot: int) -> None: ...


_OWN = (SnapshotPoint.TURN, SnapshotPoint.PROMPT)  # the points a session's own snapshots are kept at


def _longest(found: list[Snapshot], tokens: Sequence[int], limit: int) -> Snapshot | None:
    for snap in sorted(found, key=lambda s: -s.num_tokens):
        if 0 < snap.num_tokens <= limit and _digest(tokens[: snap.num_tokens]) == snap.digest:
            return snap
    return None


class SnapshotStore:
    def __init__(self, num_rows: int, num_snapshots: int, slot_bytes: int = 0) -> None:
        self.num_rows = num_rows
        self.capacity = num_snapshots
        self.slot_bytes = slot_bytes  # one slot of the state cache (StateCache.slot_bytes)
        self._free = list(range(2 * num_rows + num_snapshots - 1, 2 * num_rows - 1, -1))
        # (session id, TURN | PROMPT) or (the prefix's digest in hex, SHARED); least recently used first
        self._by_key: OrderedDict[tuple[str, SnapshotPoint], Snapshot] = OrderedDict()
        self.hits = 0
        self.saved = 0
        self.dropped = 0
        self.listener: SnapshotListener | None = None

    @staticmethod
    def num_slots(num_rows: int, num_snapshots: int) -> int:
        return 2 * num_rows + num_snapshots

    def aligned_slot(self, row: int) -> int:
        return self.num_rows + row

    def __len__(self) -> int:
        return len(self._by_key)

    def snapshots(self) -> list[Snapshot]:
        """Every snapshot held, least recently used first."""
        return list(self._by_key.values())

    def find(self, session: str | None, tokens: Sequence[int], limit: int) -> Snapshot | None:
        """The session's longest snapshot that describes a prefix of `tokens` no longer than `limit`. Pure."""
        if session is None:
            return None
        found = [s for p in _OWN if (s := self._by_key.get((session, p))) is not None]
        return _longest(found, tokens, limit)

    def find_shared(self, tokens: Sequence[int], limit: int) -> Snapshot | None:
        """The longest shared-prefix snapshot that describes a prefix of `tokens` no longer than `limit`. Pure."""
        return _longest([s for (_, p), s in self._by_key.items() if p is SnapshotPoint.SHARED], tokens, limit)

    def session_bytes(self, session: str) -> int:
        """Bytes of the session's snapshots held right now."""
        return self.slot_bytes * sum((session, p) in self._by_key for p in _OWN)

    def stats(self) -> SnapshotStats:
        n = len(self._by_key)
        return SnapshotStats(n, self.capacity, self.slot_bytes, n * self.slot_bytes, self.capacity * self.slot_bytes,
                             self.saved, self.hits, self.dropped)

    def used(self, snap: Snapshot) -> None:
        """`snap` (found by `find` or `find_shared`) is resumed from: it, and its session's other snapshot,
        become the most recently used."""
        owner = next(k for k, s in self._by_key.items() if s is snap)
        keys = [owner] if owner[1] is SnapshotPoint.SHARED else [(owner[0], p) for p in _OWN]
        for key in keys:
            if key in self._by_key:
                self._by_key.move_to_end(key)
        self.hits += 1

    def save_shared(self, tokens: Sequence[int]) -> int | None:
        """A slot for a snapshot of the shared prefix `tokens` (as `save`)."""
        return self.save(_digest(tokens).hex(), SnapshotPoint.SHARED, tokens)

    def save(self, session: str, point: SnapshotPoint, tokens: Sequence[int]) -> int | None:
        """A slot for the session's new snapshot of `tokens` at `point` (its old one's, else a free one, else
        the least recently used one's); the caller copies the state there before anything else runs."""
        old = self._by_key.pop((session, point), None)
        if old is not None:
            slot = old.slot
        elif self._free:
            slot = self._free.pop()
        elif self._by_key:
            # a shared prefix's snapshot goes before any session's: a session's is what its lease protects
            key = next((k for k in self._by_key if k[1] is SnapshotPoint.SHARED), next(iter(self._by_key)))
            slot = self._by_key.pop(key).slot
            self.dropped += 1
            if self.listener is not None:
                self.listener.dropping(slot)
        else:
            return None
        self._by_key[(session, point)] = Snapshot(slot, len(tokens), _digest(tokens))
        self.saved += 1
        if self.listener is not None:
            self.listener.saved(slot, tokens)
        return slot

    def drop(self, session: str) -> None:
        for p in _OWN:
            snap = self._by_key.pop((session, p), None)
            if snap is not None:
                self._free.append(snap.slot)
