"""Recurrent-state snapshots of hybrid models, one per session: the state at the end of its last turn.

A Gated DeltaNet layer's state resumes only at the exact position it was saved, so a cached prefix is
usable only up to a position some snapshot describes. An agent turn is append-only (turn N+1 starts with
everything turn N ended with), so one snapshot per session, taken when a turn ends, is what its next turn
needs: the KV pages of the attention layers up to that position come from the radix cache as usual.

Positions are page-aligned, like the pages the cache keeps: every running sequence has a second slot that
holds its state at the last page boundary a step ended on (engine/exec/runner.py copies it there; the
scheduler ends prefill chunks on page boundaries so the prompt's last one is such a step end). When the
turn ends, that state goes to the session's snapshot slot, with the tokens it covers (checked on lookup:
a session id is a claim, the tokens are the proof).

Slots: [0, rows) live state of running sequences, [rows, 2 rows) their page-aligned copies, then the
snapshots. A full store drops the least recently used session's snapshot (idle sessions before the ones
that just ran); the session then recomputes its history once, never resumes from a wrong position.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


def _digest(tokens: Sequence[int]) -> bytes:
    return hashlib.blake2b(np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=16).digest()


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
        self._by_session: OrderedDict[str, Snapshot] = OrderedDict()  # least recently used first
        self.hits = 0
        self.saved = 0
        self.dropped = 0

    @staticmethod
    def num_slots(num_rows: int, num_snapshots: int) -> int:
        return 2 * num_rows + num_snapshots

    def aligned_slot(self, row: int) -> int:
        return self.num_rows + row

    def __len__(self) -> int:
        return len(self._by_session)

    def find(self, session: str | None, tokens: Sequence[int], limit: int) -> Snapshot | None:
        """The session's snapshot when it describes a prefix of `tokens` no longer than `limit`. Pure."""
        snap = self._by_session.get(session) if session is not None else None
        if snap is None or snap.num_tokens > limit or snap.num_tokens == 0:
            return None
        return snap if _digest(tokens[: snap.num_tokens]) == snap.digest else None

    def used(self, session: str) -> None:
        self._by_session.move_to_end(session)
        self.hits += 1

    def save(self, session: str, tokens: Sequence[int]) -> int | None:
        """A slot for the session's new snapshot of `tokens` (its old one's, else a free one, else the least
        recently used session's); the caller copies the state there before anything else runs."""
        old = self._by_session.pop(session, None)
        if old is not None:
            slot = old.slot
        elif self._free:
            slot = self._free.pop()
        elif self._by_session:
            _, victim = self._by_session.popitem(last=False)
            slot = victim.slot
            self.dropped += 1
        else:
            return None
        self._by_session[session] = Snapshot(slot, len(tokens), _digest(tokens))
        self.saved += 1
        return slot

    def drop(self, session: str) -> None:
        snap = self._by_session.pop(session, None)
        if snap is not None:
            self._free.append(snap.slot)
