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

Slots: [0, rows) live state of running sequences, [rows, 2 rows) their page-aligned copies, then the
snapshots. A full store drops the least recently used session's snapshot (idle sessions before the ones
that just ran); the session then recomputes its history once, never resumes from a wrong position.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import numpy as np


def _digest(tokens: Sequence[int]) -> bytes:
    return hashlib.blake2b(np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=16).digest()


class SnapshotPoint(Enum):
    TURN = "turn"  # the end of a turn: prompt and answer
    PROMPT = "prompt"  # the end of its prompt


@dataclass(frozen=True)
class Snapshot:
    slot: int
    num_tokens: int  # the position the state describes (page-aligned)
    digest: bytes  # of the tokens [0, num_tokens)


class SnapshotStore:
    def __init__(self, num_rows: int, num_snapshots: int) -> None:
        self.num_rows = num_rows
        self.capacity = num_snapshots
        self._free = list(range(2 * num_rows + num_snapshots - 1, 2 * num_rows - 1, -1))
        self._by_key: OrderedDict[tuple[str, SnapshotPoint], Snapshot] = OrderedDict()  # LRU first
        self.hits = 0
        self.saved = 0
        self.dropped = 0

    @staticmethod
    def num_slots(num_rows: int, num_snapshots: int) -> int:
        return 2 * num_rows + num_snapshots

    def aligned_slot(self, row: int) -> int:
        return self.num_rows + row

    def __len__(self) -> int:
        return len(self._by_key)

    def find(self, session: str | None, tokens: Sequence[int], limit: int) -> Snapshot | None:
        """The session's longest snapshot that describes a prefix of `tokens` no longer than `limit`. Pure."""
        if session is None:
            return None
        found = [s for p in SnapshotPoint if (s := self._by_key.get((session, p))) is not None]
        for snap in sorted(found, key=lambda s: -s.num_tokens):
            if 0 < snap.num_tokens <= limit and _digest(tokens[: snap.num_tokens]) == snap.digest:
                return snap
        return None

    def used(self, session: str) -> None:
        for p in SnapshotPoint:
            if (session, p) in self._by_key:
                self._by_key.move_to_end((session, p))
        self.hits += 1

    def save(self, session: str, point: SnapshotPoint, tokens: Sequence[int]) -> int | None:
        """A slot for the session's new snapshot of `tokens` at `point` (its old one's, else a free one, else
        the least recently used one's); the caller copies the state there before anything else runs."""
        old = self._by_key.pop((session, point), None)
        if old is not None:
            slot = old.slot
        elif self._free:
            slot = self._free.pop()
        elif self._by_key:
            _, victim = self._by_key.popitem(last=False)
            slot = victim.slot
            self.dropped += 1
        else:
            return None
        self._by_key[(session, point)] = Snapshot(slot, len(tokens), _digest(tokens))
        self.saved += 1
        return slot

    def drop(self, session: str) -> None:
        for p in SnapshotPoint:
            snap = self._by_key.pop((session, p), None)
            if snap is not None:
                self._free.append(snap.slot)
