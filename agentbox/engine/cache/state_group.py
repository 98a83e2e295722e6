"""A model's state group in the cache: where a request can resume, where its prefill chunks end, and which state
snapshots its steps leave (the snapshots themselves: state_snapshots.py; on disk: disk_states.py).

A state (a Gated DeltaNet layer's, a sliding ring's) describes exactly one position, so a cached prefix resumes
only where a snapshot describes the state; with none, the request computes from the start. This is the cache's
decision (manager.py asks here), not the scheduler's:
- `resume` cuts a page match to the longest prefix a snapshot resumes (the session's own, a shared prefix's,
  another session's whose tokens are the same prefix, or one on disk from before a restart). When the pages reach further than any snapshot (a prefix other sessions
  sent), the request keeps its state there as a shared snapshot (`share_at`).
- `chunk` ends a prefill chunk on a page boundary when it can, and always on the prompt's last one and on the
  shared point: the runner keeps the state at such step ends (its page-aligned copy), and the position a turn
  ends on (its cached pages) must be one of them.
- `save_turn` (when the request's pages go into the tree), `save_prompts` (before each schedule: a prompt whose
  last page boundary was just computed) take snapshots from the row's page-aligned copy, when it holds exactly
  that position (`SeqCache.aligned_at`, as the runner reported it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from agentbox.engine.cache.disk_states import DiskSnapshot, DiskStates
from agentbox.engine.cache.radix_node import Match, Tier
from agentbox.engine.cache.seq_cache import SeqCache
from agentbox.engine.cache.state_snapshots import Snapshot, SnapshotPoint, SnapshotStore


@dataclass(frozen=True)
class Resume:
    """Where a match's state comes from: a snapshot held in a slot, or one on disk to read into a slot (then
    `fallback` is what the match resumes if the read fails)."""

    snapshot: Snapshot | None
    disk: DiskSnapshot | None = None
    fallback: Snapshot | None = None

    @property
    def num_tokens(self) -> int:
        if self.disk is not None:
            return self.disk.num_tokens
        return self.snapshot.num_tokens if self.snapshot is not None else 0


class StateGroupCache:
    def __init__(self, store: SnapshotStore, disk: DiskStates | None, page_size: int) -> None:
        self.store = store
        self.disk = disk
        self.ps = page_size
        self._seeding: set[int] = set()  # slots requests admitted this step seed from (never overwritten)

    # ---- where a request resumes ----

    def resume(self, m: Match, tokens: Sequence[int]) -> tuple[Resume, int]:
        """The snapshot m resumes at (or none), and the position a shared snapshot should be kept at (0: none).
        Pure: what it finds on disk is only named here; `load` reads it."""
        store = self.store
        snap = store.find_any(tokens, m.num_tokens)  # the session's own, a shared prefix's, or another session's
        disk = self.disk.find(snap, tokens, m.num_tokens) if self.disk is not None else None
        res = Resume(snap) if disk is None else Resume(None, disk, snap)
        share_at = m.num_tokens // self.ps * self.ps
        return res, share_at if share_at > res.num_tokens else 0

    def cut(self, m: Match, upto: int) -> Match:
        """m cut to its first `upto` tokens (a snapshot's position: page-aligned, at most m.num_tokens)."""
        if upto == 0:
            return Match((), 0, 0, m.session, m.epoch)
        path = tuple(n for n in m.path if n.start < upto)
        host = sum(min(n.start + len(n.key), upto) - n.start for n in path if n.tier is Tier.HOST)
        below = m.below
        mem = m.num_tokens - (below.num_tokens if below is not None else 0)
        k = max(0, upto - mem) // self.ps  # pages below memory kept
        if below is not None:
            below = type(below)(below.refs[:k], below.tokens[: k * self.ps]) if k else None
        return Match(path, upto, host + k * self.ps, m.session, m.epoch, below)

    def load(self, res: Resume, tokens: Sequence[int]) -> Snapshot | None:
        """The snapshot `res` names, in a slot: one on disk is read into a store slot now (between steps), else
        the fallback. Marks it used and reserves its slot for the admission's seed."""
        snap = res.snapshot
        if res.disk is not None:
            assert self.disk is not None
            snap = self.disk.load(res.disk, tokens, self._seeding) or res.fallback
        if snap is not None:
            self.store.used(snap)
            self._seeding.add(snap.slot)
        return snap

    def seeded(self, slot: int) -> None:
        """The seed copy from `slot` is in the next step's copies: the slot is the store's again."""
        self._seeding.discard(slot)

    # ---- where chunks end ----

    def chunk(self, h: SeqCache, start: int, n: int, num_tokens: int) -> int:
        """A prefill chunk of up to n tokens from `start` cut to end on a page boundary when it can, and at the
        shared point, the prompt snapshot's point and the last page boundary of the sequence's tokens always."""
        ps = self.ps
        end = start + n
        if start < h.share_at < end:
            return h.share_at - start
        if start < h.prompt_at < end:
            return h.prompt_at - start
        last_boundary = num_tokens // ps * ps
        if end < num_tokens and end // ps * ps > start:
            return end // ps * ps - start
        if end == num_tokens and start < last_boundary < end:
            return last_boundary - start
        return n

    # ---- snapshots the steps leave ----

    def save_turn(self, h: SeqCache, session: str | None, tokens: Sequence[int]) -> None:
        """The session's snapshot of its state at the end of the pages just cached, when the runner's page-aligned
        copy is at exactly that position (it always is at a turn's end: `chunk`)."""
        if session is None or not tokens or h.aligned_at != len(tokens):
            return
        src = self.store.aligned_slot(h.row)
        if self.store.save(session, SnapshotPoint.TURN, tokens, src) and self.disk is not None:
            self.disk.write_behind(tokens, src)  # with the turn's pages (radix_disk.py): a crash loses neither

    def save_prompt(self, h: SeqCache, session: str | None, tokens: Sequence[int], num_prompt: int,
                    computed: int) -> None:
        """A running sequence whose last step ended on its prompt snapshot's point (`SeqCache.prompt_at`, else the
        prompt's last page boundary): that state becomes the session's prompt snapshot (copied before the next step
        can overwrite it); one whose last step ended at its shared point: a shared snapshot. `computed`: where the
        sequence stands (a ring's state is exactly at the snapshot's position when it is that position)."""
        store = self.store
        at = h.share_at
        if at and h.aligned_at == at:
            h.share_at = 0
            store.save_shared(tokens[:at], store.aligned_slot(h.row), computed == at)
        boundary = h.prompt_at or num_prompt // self.ps * self.ps
        if h.prompt_saved or boundary == 0 or h.aligned_at != boundary:
            return
        h.prompt_saved = True
        if session is not None:
            store.save(session, SnapshotPoint.PROMPT, tokens[:boundary], store.aligned_slot(h.row),
                       computed == boundary)

    def take_copies(self) -> list[tuple[int, int]]:
        return self.store.take_copies()

    def persist(self) -> int:
        """A graceful stop: every snapshot to disk, after the copies queued for a next step that will not run.
        Returns the snapshots written."""
        return self.disk.persist(self.store.take_copies()) if self.disk is not None else 0
