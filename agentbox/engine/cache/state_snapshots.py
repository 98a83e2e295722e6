"""Recurrent-state snapshots of hybrid models: per session the state at the end of its last turn, at the end of
that turn's prompt, and earlier such points of the same conversation while slots are free.

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

History: a session's replaced TURN or PROMPT snapshot stays as a HISTORY point when it describes a prefix of
the new one (the same conversation, earlier). It is what eviction leaves the session when its newest pages go
(state_units.py cuts a session back to its deepest snapshot left, the way a dense model keeps the pages left):
measured in bench/results/hybrid-replay. History points are the first to go when slots run out.

Shared prefixes: a new session's first turn usually repeats a prefix another session sent (the agent's system
prompt and tool definitions). When the radix cache knows a longer prefix than any snapshot can resume (`match`
found pages up to position L, the divergence point with the sessions it knows), the request ends a chunk at L
and that state is kept as a SHARED snapshot, keyed by the digest of tokens [0, L) instead of a session: the
next session that sends the same L tokens resumes there. What it covers: positions where a radix match ended
for some request (page-aligned, as pages are); the first session to reach a divergence point pays for it
once, later ones do not. It does not cover a prefix only ever sent once (no request found it in the tree).

Slots (layers/recurrent_state.py's StateCache): [0, rows) live state of running sequences, [rows, 2 rows) their
page-aligned copies, then the device snapshots (on a small card the last of them in host memory), then the host
snapshots (host RAM, `host_state_snapshots`). Sliding-window rings (layers/window_kv.py) keep a page of slack and
are their own page-aligned copies (`in_place`): [0, rows) live rings, then the snapshots.

A ring's snapshot taken where its ring stands exactly (`exact`: a prompt's or a shared point's chunk ended there)
resumes a page before its own position too (`back`: its slack holds every position a sequence resuming there
reads), so it carries the digest of that shorter prefix beside its own. A turn's snapshot does not: its ring ran on
past the position (the answer's last partial page), which already spends the slack. That is what a next turn
needs when its template drops the end of the last prompt (Gemma 4's generation prompt closes an empty thought
channel that the history does not repeat): the turn diverges a few tokens before the prompt's snapshot, and
without this the turn would resume from the previous turn's snapshot or from nothing (tests/test_gemma4_sessions_http.py:
a later turn 0 % cached when the prompt ended just past a page boundary).
The store decides, the runner copies: every move is a (src, dst) slot pair, taken with `take_copies` into the
next step, in order. A full device store demotes its first victim to host (history points, then shared
prefixes, then the least recently used session's); a full host store drops its own first victim. A match that
lands on a host snapshot seeds the request's row from host memory (the copy a promotion makes; the session's
next snapshots are taken on the device). A snapshot whose pages are evicted goes with them (`discard`). What
was dropped is recomputed once, never resumed from a wrong position.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import Enum
from typing import Protocol

import numpy as np

from agentbox.engine.cache.radix_node import Tier


def digest(tokens: Sequence[int]) -> bytes:
    """A snapshot's prefix hash: blake2b-128 of the tokens as int64 (state_units.py hashes the same bytes)."""
    return hashlib.blake2b(np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=16).digest()


class SnapshotPoint(Enum):
    TURN = "turn"  # the end of a turn: prompt and answer
    PROMPT = "prompt"  # the end of its prompt
    SHARED = "shared"  # a prefix several sessions sent (keyed by its tokens' digest, not by a session)
    HISTORY = "history"  # an earlier TURN or PROMPT point of the same conversation


@dataclass(frozen=True)
class SnapshotStats:
    """What the store holds (/v1/stats `snapshots`). Bytes are this rank's: slots x the real size of one slot
    of the state cache's tensors (at tensor parallel size N each rank holds 1/N of the heads). Counts and
    bytes are the device store's; `host_*` the host store's."""

    count: int
    capacity: int
    slot_bytes: int
    used_bytes: int
    capacity_bytes: int
    saved: int
    hits: int  # resumed from (either tier)
    dropped: int  # no slot left on any tier: the first victim went
    evicted: int = 0  # their pages were evicted: they went with them
    host_count: int = 0
    host_capacity: int = 0
    demoted: int = 0  # copied to host to free a device slot
    promoted: int = 0  # of the hits, resumed from host


@dataclass(frozen=True)
class Snapshot:
    slot: int  # in the state cache's slot space (device slots, then host slots)
    num_tokens: int  # the position the state describes (page-aligned)
    digest: bytes  # of the tokens [0, num_tokens)
    tier: Tier = Tier.GPU
    back_digest: bytes | None = None  # a ring's: of the tokens [0, num_tokens - back), where it resumes too


def _digests(tokens: Sequence[int], back: int) -> tuple[bytes, bytes | None]:
    """(digest of tokens, digest of all but their last `back`) in one pass; the second None without `back`."""
    h = hashlib.blake2b(digest_size=16)
    cut = len(tokens) - back
    if not back or cut <= 0:
        return digest(tokens), None
    h.update(np.asarray(tokens[:cut], dtype=np.int64).tobytes())
    shorter = h.copy().digest()
    h.update(np.asarray(tokens[cut:], dtype=np.int64).tobytes())
    return h.digest(), shorter


class SnapshotListener(Protocol):
    """Told when a slot gets a snapshot, when one moves to another slot (demoted to host), and when one is about
    to leave memory for good (the disk tier's hook: disk_states.py)."""

    def saved(self, slot: int, tokens: Sequence[int]) -> None: ...

    def moved(self, src: int, dst: int) -> None: ...

    def dropping(self, slot: int) -> None: ...


Key = tuple[str, SnapshotPoint, int]  # (session, point, 0) | (session, HISTORY, position) | (digest hex, SHARED, 0)
_OWN = (SnapshotPoint.TURN, SnapshotPoint.PROMPT, SnapshotPoint.HISTORY)  # a session's own points
_VICTIMS = (SnapshotPoint.HISTORY, SnapshotPoint.SHARED, None)  # the order a full tier gives up; None: any


def _longest(found: list[Snapshot], tokens: Sequence[int], limit: int, back: int) -> Snapshot | None:
    """The longest of `found` whose digest is that of tokens' prefix of its length, or a ring's resumed `back`
    positions before its own (then a view of it at that position: the same slot). The prefixes' digests come
    from one pass over the tokens (a lookup over every snapshot held reads the tokens once, not once each)."""
    points = [(s.num_tokens, s.digest, s) for s in found]
    points += [(s.num_tokens - back, s.back_digest, s) for s in found if s.back_digest is not None]
    candidates = sorted((p for p in points if 0 < p[0] <= limit), key=lambda p: p[0])
    h, at, best = hashlib.blake2b(digest_size=16), 0, None
    for n, d, snap in candidates:
        h.update(np.asarray(tokens[at:n], dtype=np.int64).tobytes())
        at = n
        if h.copy().digest() == d:
            best = snap if n == snap.num_tokens else replace(snap, num_tokens=n, digest=d, back_digest=None)
    return best


class SnapshotStore:
    def __init__(self, num_rows: int, num_snapshots: int, slot_bytes: int = 0, in_place: bool = False,
                 num_host: int = 0, back: int = 0) -> None:
        """back: positions before its own a snapshot also resumes at (a ring's slack, a page; 0: none)."""
        self.num_rows = num_rows
        self.capacity = num_snapshots
        self.host_capacity = num_host
        self.slot_bytes = slot_bytes  # one slot of the state cache (StateCache.slot_bytes)
        self.in_place = in_place
        self.back = back
        first = self.num_slots(num_rows, 0, in_place)
        self._free = {Tier.GPU: list(range(first + num_snapshots - 1, first - 1, -1)),
                      Tier.HOST: list(range(first + num_snapshots + num_host - 1, first + num_snapshots - 1, -1))}
        self._by_key: OrderedDict[Key, Snapshot] = OrderedDict()  # least recently used first
        self._copies: list[tuple[int, int]] = []
        self.hits = self.saved = self.dropped = self.evicted = self.demoted = self.promoted = 0
        self.listener: SnapshotListener | None = None

    @staticmethod
    def num_slots(num_rows: int, num_snapshots: int, in_place: bool = False) -> int:
        """Device slots of the state cache (the host ones come after them)."""
        return (1 if in_place else 2) * num_rows + num_snapshots

    def aligned_slot(self, row: int) -> int:
        return row if self.in_place else self.num_rows + row

    def __len__(self) -> int:
        return len(self._by_key)

    def take_copies(self) -> list[tuple[int, int]]:
        """The (src, dst) slot copies decided since the last call, in order: the runner makes them before the
        next step (before its seeds, which may read them)."""
        out, self._copies = self._copies, []
        return out

    def pending_slots(self) -> set[int]:
        """Slots a queued copy fills at the next step (what they hold now is not their snapshot yet)."""
        return {dst for _, dst in self._copies}

    def cancel_copies(self, slot: int) -> None:
        """Drop the queued copies into `slot` (the caller filled it itself)."""
        self._copies = [c for c in self._copies if c[1] != slot]

    def snapshots(self) -> list[Snapshot]:
        """Every snapshot held, least recently used first."""
        return list(self._by_key.values())

    # ---- lookups (pure) ----

    def _own(self, session: str) -> list[Key]:
        return [k for k in self._by_key if k[0] == session and k[1] in _OWN]

    def find(self, session: str | None, tokens: Sequence[int], limit: int) -> Snapshot | None:
        """The session's longest snapshot that describes a prefix of `tokens` no longer than `limit`. Pure."""
        if session is None:
            return None
        return _longest([self._by_key[k] for k in self._own(session)], tokens, limit, self.back)

    def find_shared(self, tokens: Sequence[int], limit: int) -> Snapshot | None:
        """The longest shared-prefix snapshot that describes a prefix of `tokens` no longer than `limit`. Pure."""
        return _longest([s for k, s in self._by_key.items() if k[1] is SnapshotPoint.SHARED], tokens, limit,
                        self.back)

    def find_any(self, tokens: Sequence[int], limit: int) -> Snapshot | None:
        """The longest snapshot of any owner (a session's points, a shared prefix) that describes a prefix of
        `tokens` no longer than `limit`: the digest is the proof, whoever saved it. A new session sending the
        prompt another session sent resumes at that session's prompt snapshot. Pure."""
        return _longest(list(self._by_key.values()), tokens, limit, self.back)

    def after(self, position: int) -> list[Snapshot]:
        """Every snapshot held at a position past `position` (state_units.py: which ones a node's pages resume)."""
        return [s for s in self._by_key.values() if s.num_tokens > position]

    def session_bytes(self, session: str) -> int:
        """Bytes of the session's snapshots held on the device right now (what `used_bytes` counts)."""
        return self.slot_bytes * sum(self._by_key[k].tier is Tier.GPU for k in self._own(session))

    def stats(self) -> SnapshotStats:
        on_host = sum(s.tier is Tier.HOST for s in self._by_key.values())
        n = len(self._by_key) - on_host
        return SnapshotStats(n, self.capacity, self.slot_bytes, n * self.slot_bytes, self.capacity * self.slot_bytes,
                             self.saved, self.hits, self.dropped, self.evicted, on_host, self.host_capacity,
                             self.demoted, self.promoted)

    # ---- changes ----

    def used(self, snap: Snapshot) -> None:
        """`snap` (found by `find` or `find_shared`, or a view of it a page back) is resumed from: it, and its
        session's other snapshots, become the most recently used."""
        owner = next(k for k, s in self._by_key.items() if s.slot == snap.slot)
        for key in [owner] if owner[1] is SnapshotPoint.SHARED else self._own(owner[0]):
            self._by_key.move_to_end(key)
        self.hits += 1
        self.promoted += snap.tier is Tier.HOST

    def save_shared(self, tokens: Sequence[int], src: int, exact: bool = False) -> bool:
        """Keep the state in slot `src` as the snapshot of the shared prefix `tokens` (as `save`)."""
        return self.save(digest(tokens).hex(), SnapshotPoint.SHARED, tokens, src, exact)

    def save(self, owner: str, point: SnapshotPoint, tokens: Sequence[int], src: int, exact: bool = False) -> bool:
        """Keep the state in slot `src` (the caller's page-aligned copy) as the session's snapshot of `tokens`
        at `point`, in a device slot: its old one's, a free one, or its first victim's (demoted to host where
        it has room). The copy is queued for the next step. False when no slot could be had. `exact`: the state
        stands at exactly len(tokens) (a ring's then also resumes `back` positions earlier)."""
        d, back = _digests(tokens, self.back if exact else 0)
        old = self._by_key.pop((owner, point, 0), None)
        if old is not None and point is not SnapshotPoint.SHARED and _prefix_of(old, tokens):
            hist = (owner, SnapshotPoint.HISTORY, old.num_tokens)
            if hist in self._by_key:
                self._release(self._by_key.pop(hist))
            self._by_key[hist] = old  # an earlier point of the same conversation
        elif old is not None:
            self._release(old)
        slot = self._slot(Tier.GPU)
        if slot is None:
            return False
        self._by_key[(owner, point, 0)] = Snapshot(slot, len(tokens), d, back_digest=back)
        self._copies.append((src, slot))
        self.saved += 1
        if self.listener is not None:
            self.listener.saved(slot, tokens)
        return True

    def adopt(self, owner: str, tokens: Sequence[int]) -> int | None:
        """A device slot for a snapshot of `tokens` the caller writes into it now (read back from disk), under
        `owner`'s TURN point; every queued copy runs first (`take_copies`: the caller makes them), since a
        victim's demotion reads the slot. None when no slot could be had."""
        slot = self._slot(Tier.GPU)
        if slot is None:
            return None
        self._by_key[(owner, SnapshotPoint.TURN, 0)] = Snapshot(slot, len(tokens), digest(tokens))
        if self.listener is not None:
            self.listener.saved(slot, tokens)
        return slot

    def discard(self, snap: Snapshot) -> None:
        """The pages `snap` resumes on were evicted: it goes with them (counted in `evicted`)."""
        key = next((k for k, s in self._by_key.items() if s is snap), None)
        if key is not None:
            if self.listener is not None:
                self.listener.dropping(snap.slot)
            self._release(self._by_key.pop(key))
            self.evicted += 1

    def drop(self, session: str) -> None:
        for key in self._own(session):
            self._release(self._by_key.pop(key))

    def _release(self, snap: Snapshot) -> None:
        self._free[snap.tier].append(snap.slot)

    def _victim(self, tier: Tier) -> Key | None:
        for point in _VICTIMS:
            key = next((k for k, s in self._by_key.items() if s.tier is tier and point in (None, k[1])), None)
            if key is not None:
                return key
        return None

    def _slot(self, tier: Tier) -> int | None:
        """A free slot of `tier`, else its first victim's: a device victim moves to host when it can."""
        if self._free[tier]:
            return self._free[tier].pop()
        key = self._victim(tier)
        if key is None:
            return None
        snap = self._by_key.pop(key)
        host = self._slot(Tier.HOST) if tier is Tier.GPU and self.host_capacity else None
        if host is None:
            self.dropped += 1
            if self.listener is not None:
                self.listener.dropping(snap.slot)
            return snap.slot
        self._copies.append((snap.slot, host))
        if self.listener is not None:
            self.listener.moved(snap.slot, host)
        self._by_key[key] = replace(snap, slot=host, tier=Tier.HOST)
        self._by_key.move_to_end(key, last=False)  # it keeps its place in the order: it was a victim
        self.demoted += 1
        return snap.slot


def _prefix_of(old: Snapshot, tokens: Sequence[int]) -> bool:
    """old describes a proper prefix of tokens."""
    return old.num_tokens < len(tokens) and digest(tokens[: old.num_tokens]) == old.digest
