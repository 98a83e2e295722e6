"""`CacheManager`: the one interface the scheduler and the core use for everything cached. They import this
module and nothing else of engine/cache/ (tests/test_import_graph.py), and see only `Match`, `Lock` and a
request's opaque cache handle (`SeqCache`).

It composes what the model's layout declares (layers/cache_layout.py):
- the paged groups: one radix tree over the device pool's page ids, which every paged group shares, with the
  slower tiers chained below it (page_cache.py is the contract, radix_cache.py the tree, cache_policies.py the
  policies; host_tier.py and radix_disk.py the tiers);
- the state group, when the model has one: snapshots at turn ends and shared-prefix points, resumed only where
  they describe the state (state_group.py, state_snapshots.py, disk_states.py);
- the rows a running request holds: its page-table row and live state slot (rows.py).

Look, then take:
- `match` is pure: the longest prefix resumable in every group (pages for the paged groups; for the state group,
  only up to a snapshot), and the session (given, else inferred).
- `fits(match, pages)` is pure: whether pages for the request can be had without touching its match.
- `lock(match)` commits: the pages (slower tiers copied in), the row, the state seed (a snapshot read back from
  disk first when the match resumes from one). All or nothing for a model with state: a lock that comes back
  short (host pages that found no room, a torn disk chunk) would end where no snapshot describes the state, so
  the request computes from the start instead.
- `grow`, `trim` change a handle's pages; `release` hands a request's computed pages to the tree (taking the
  turn's snapshot) and gives the rest back.
"""

from __future__ import annotations

import time
from array import array
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

from agentbox.config import CachePolicy, EngineConfig
from agentbox.engine.cache.cache_policies import kv_manager
from agentbox.engine.cache.disk_states import disk_states
from agentbox.engine.cache.kv_pool import PagePool
from agentbox.engine.cache.page_cache import PageCache, TurnStart
from agentbox.engine.cache.radix_node import Lock as PageLock
from agentbox.engine.cache.radix_node import Match as PageMatch
from agentbox.engine.cache.radix_node import Tier
from agentbox.engine.cache.rows import RowPool
from agentbox.engine.cache.seq_cache import SeqCache
from agentbox.engine.cache.session_view import session_detail, session_summary
from agentbox.engine.cache.sessions import Session, SessionTable, TurnRecord
from agentbox.engine.cache.state_group import Resume, StateGroupCache
from agentbox.engine.cache.state_snapshots import SnapshotStats, SnapshotStore
from agentbox.engine.cache.stats import CacheStats, SessionDetail, SessionSummary
from agentbox.layers.backends.base import KVCache
from agentbox.layers.recurrent_state import StateCache

__all__ = ["CacheManager", "CacheShape", "Lock", "Match", "SeqCache", "TurnRecord", "TurnStart", "build_cache"]


class CachedSeq(Protocol):
    """What the cache reads of a request (engine/request.py) when its pages go back or its snapshots are taken."""

    cache_handle: SeqCache | None
    session_id: str | None
    num_computed_tokens: int
    num_prompt_tokens: int

    @property
    def all_token_ids(self) -> list[int]: ...

    def token_array(self, n: int) -> array | None: ...


@dataclass(frozen=True)
class Match:
    """What `CacheManager.match` found, holding nothing: valid until the cache next changes."""

    pages: PageMatch
    resume: Resume | None  # the state it resumes from (a model with a state group); None otherwise
    share_at: int = 0  # > 0: the request keeps its state there as a shared-prefix snapshot

    @property
    def num_tokens(self) -> int:
        return self.pages.num_tokens

    @property
    def num_resident_tokens(self) -> int:
        """Tokens whose pages a lock shares as they are: the request needs new pages for the rest."""
        return self.pages.num_resident_tokens

    @property
    def session(self) -> str | None:
        return self.pages.session


@dataclass(frozen=True)
class Lock:
    """What `CacheManager.lock` gave the request: its handle (pages, row, seed) and what it may be told."""

    handle: SeqCache
    num_tokens: int
    pages: PageLock  # for the turn's accounting (begin_turn)

    @property
    def session(self) -> str | None:
        return self.pages.session


@dataclass(frozen=True)
class CacheShape:
    """What the runner allotted for the cache (engine/exec/runner.py): the pool, the rows, the state slots."""

    kv: KVCache
    num_pages: int
    page_size: int
    num_rows: int
    state: StateCache | None = None
    num_snapshots: int = 0
    num_host_snapshots: int = 0
    state_in_place: bool = False  # rings: the live slot is its own page-aligned copy


class CacheManager:
    def __init__(self, pages: PageCache, rows: RowPool, state: StateGroupCache | None = None) -> None:
        self._pages = pages
        self._pool = pages.pool
        self._rows = rows
        self._state = state
        self.ps = self._pool.page_size

    # ---- what callers may read ----

    @property
    def page_size(self) -> int:
        return self.ps

    @property
    def capacity(self) -> int:
        """Device pages a request may ever hold (the pool's, less its null page)."""
        return self._pool.capacity

    @property
    def num_free(self) -> int:
        return self._pool.num_free

    @property
    def has_state(self) -> bool:
        """The model has a state group: a prefix resumes only where a snapshot describes its state."""
        return self._state is not None

    @property
    def gates_new_sessions(self) -> bool:
        return self._pages.gates_new_sessions

    @property
    def caches_completions(self) -> bool:
        return self._pages.caches_completions

    @property
    def sessions(self) -> SessionTable:
        """The session table, to read. Writes go through the turn lifecycle below."""
        return self._pages.sessions

    @property
    def clock(self) -> Callable[[], float]:
        return self._pages.clock

    @property
    def page_cache(self) -> PageCache:
        """The paged half, for tests and benchmarks that drive the tree directly (the scheduler and the core
        never do)."""
        return self._pages

    @property
    def state_group(self) -> StateGroupCache | None:
        """The state group (its snapshot store and disk side), for tests and benchmarks; None without one."""
        return self._state

    # ---- look, then take ----

    def match(self, tokens: Sequence[int], session: str | None = None, namespace: str = "",
              end: int | None = None) -> Match:
        m = self._pages.match(tokens, session, namespace, end)
        if self._state is None:
            return Match(m, None)
        res, share_at = self._state.resume(m, tokens)
        return Match(self._state.cut(m, res.num_tokens), res, share_at)

    def visible_tokens(self, m: Match, namespace: str) -> int:
        """Of m's tokens, those a request of `namespace` may be told are cached. Pure."""
        return self._pages.visible_tokens(m.pages, namespace)

    def fits(self, m: Match, need_pages: int) -> bool:
        """need_pages new device pages can be had beside m's once it is locked (free, or freed by eviction
        without touching m or another request's lock). Pure."""
        return need_pages <= self._pool.num_free or need_pages <= self._pages.reclaimable(m.pages)

    def lock(self, m: Match, tokens: Sequence[int], history_end: int = 0) -> Lock:
        """Commit m for a request of `tokens`: its pages, a row, and for a model with state its seed (all or
        nothing, see the module notes). `history_end` (> 0): where its prompt's history ends (Request.history_end),
        so its prompt snapshot is taken where the next turn can resume."""
        state = self._state
        pm, seed = m.pages, None
        if state is not None and m.resume is not None and m.resume.num_tokens:
            snap = state.load(m.resume, tokens)
            have = snap.num_tokens if snap is not None else 0
            if have < m.num_tokens:  # the disk's snapshot could not be read: the fallback's prefix, or nothing
                pm = state.cut(pm, have)
            seed = snap.slot if snap is not None else None
        lock = self._pages.lock(pm)
        if state is not None and lock.num_tokens != pm.num_tokens:
            self._pages.release(lock.pages)
            if seed is not None:
                state.seeded(seed)
            seed, lock = None, PageLock([], 0, 0, lock.session)
        h = SeqCache(list(lock.pages), self._rows.take(lock.session))
        h.seed = seed
        h.share_at = m.share_at  # past any position the lock can resume at (it is only set so)
        h.prompt_at = history_end // self.ps * self.ps
        return Lock(h, lock.num_tokens, lock)

    def unlock(self, lock: Lock) -> None:
        """Undo a lock whose request could not start after all (no room for its first chunk): its references
        and row go back. The tree keeps what the lock touched (tags, recency, promoted pages)."""
        h = lock.handle
        self._pages.release(h.pages)
        self._rows.give_back(h.row)
        if h.seed is not None and self._state is not None:
            self._state.seeded(h.seed)

    def pages_short(self, h: SeqCache, num_tokens: int) -> int:
        """Pages the handle lacks to hold num_tokens tokens."""
        return -(-num_tokens // self.ps) - len(h.pages)

    def grow(self, h: SeqCache, num_tokens: int) -> bool:
        """Reserve pages so the handle holds num_tokens tokens (evicting for them); False when they cannot be had
        (nothing taken)."""
        need = self.pages_short(h, num_tokens)
        if need <= 0:
            return True
        pages = self._pages.reserve(need)
        if pages is None:
            return False
        h.pages.extend(pages)
        return True

    def trim(self, h: SeqCache, num_tokens: int) -> None:
        """The pages past what num_tokens tokens need go back (a rejected draft's tail)."""
        gone = h.cut(-(-num_tokens // self.ps))
        if gone:
            self._pages.release(gone)

    def release(self, seq: CachedSeq) -> None:
        """A request stops running (finished, aborted, preempted): its computed tokens' whole pages go to the tree
        (with its turn's snapshot), the rest of its pages and its row go back."""
        h = seq.cache_handle
        if h is None:
            return
        # The last sampled token has no KV yet, so only computed tokens are cached, whole pages only.
        full = seq.num_computed_tokens // self.ps
        # The int32 array where there is one (the cache compares it at C speed), except for a model with state,
        # whose snapshots digest a list.
        arr = seq.token_array(full * self.ps) if self._state is None else None
        tokens = seq.all_token_ids[: full * self.ps] if arr is None else arr
        # The partial tail first: the free list is a stack, so pages freed after it come back before it and
        # the next request gets an ascending run (the torch backend's no-copy view path needs one).
        if len(h.pages) > full:
            self._pages.release(h.pages[full:])
        self._pages.insert(tokens, h.pages[:full], seq.session_id)
        if self._state is not None:
            self._state.save_turn(h, seq.session_id, tokens)
        h.pages = []
        self._rows.give_back(h.row)

    def publish(self, seq: CachedSeq) -> None:
        """A prefilling request's computed whole prompt pages go to the tree now, beside its own references, so a
        request admitted before it ends resumes on them: four agents that start together on one 2,000-token system
        prompt computed it four times. The tree takes a reference of its own (a page a running request also holds is
        locked: never evicted); the insert at `release` then finds them and drops the duplicate. Not for a model
        with state: its prefixes resume only at snapshots (state_group.py)."""
        h = seq.cache_handle
        if h is None or self._state is not None or self._pages.policy is CachePolicy.NONE:
            return  # NONE: nothing would match them
        full = min(seq.num_computed_tokens, seq.num_prompt_tokens) // self.ps
        if full <= h.published:
            return
        arr = seq.token_array(full * self.ps)
        pages = h.pages[:full]
        self._pool.incref(pages)
        self._pages.insert(seq.all_token_ids[: full * self.ps] if arr is None else arr, pages)
        h.published = full

    # ---- the state group: chunks, snapshots, copies ----

    def chunk(self, h: SeqCache, start: int, n: int, num_tokens: int) -> int:
        """How many of the next n tokens from `start` a step computes (a model with state ends prefill chunks
        where its snapshots can be taken: state_group.py)."""
        return n if self._state is None else self._state.chunk(h, start, n, num_tokens)

    def before_schedule(self, running: Sequence[CachedSeq]) -> None:
        """Snapshots the last step made possible (a prompt's last page boundary, a shared point): queued before
        the next step can overwrite the state they copy."""
        if self._state is None:
            return
        for seq in running:
            h = seq.cache_handle
            if h is not None:
                self._state.save_prompt(h, seq.session_id, seq.all_token_ids, seq.num_prompt_tokens,
                                        seq.num_computed_tokens)

    def step_copies(self, handles: Sequence[SeqCache]) -> list[tuple[int, int]]:
        """The state-slot copies (src, dst) to run before the next step, in order: the snapshots decided since
        the last step, then the seeds of the requests it admitted (a seed may read a snapshot just saved)."""
        if self._state is None:
            return []
        copies = self._state.take_copies()
        for h in handles:
            if h.seed is not None:
                copies.append((h.seed, h.row))
                self._state.seeded(h.seed)
                h.seed = None
        return copies

    def aligned(self, h: SeqCache, position: int) -> None:
        """The runner's report: the handle's row now keeps its state at `position` aside (a page boundary)."""
        h.aligned_at = position

    # ---- admission and sessions ----

    def admits_new_session(self, need_pages: int, running: Sequence[SeqCache]) -> bool:
        """Running work plus live leases leave room for a new session needing need_pages."""
        held = len({p for h in running for p in h.pages})
        return self._pages.admits_new_session(need_pages, held)

    def knows(self, session: str | None) -> bool:
        return self._pages.knows(session)

    def next_lease_expiry(self) -> float | None:
        expiries = [s.lease_expiry for s in self._pages.sessions.live() if s.lease_expiry is not None]
        return min(expiries, default=None)

    def begin_turn(self, given: str | None, lock: Lock, namespace: str, prompt: Sequence[int],
                   shown: int | None = None) -> TurnStart:
        return self._pages.begin_turn(given, lock.pages, namespace, prompt, shown)

    def first_token(self, session: str, ttft_s: float, record: TurnRecord) -> None:
        self._pages.first_token(session, ttft_s, record)

    def complete_turn(self, session: str, completion_tokens: int) -> None:
        self._pages.complete_turn(session, completion_tokens)

    def end_turn(self, session: str) -> None:
        self._pages.end_turn(session)

    def forget_session(self, session: str) -> int:
        return self._pages.forget_session(session)

    def prefetch(self, tokens: Sequence[int], session: str | None, namespace: str, end: int) -> None:
        self._pages.prefetch(tokens, session, namespace, end)

    def persist(self, budget_s: float) -> tuple[int, int, int]:
        """A graceful stop: pages and the session table to the disk tier within budget_s, then the state
        snapshots. Returns (pages written, pages left unwritten, snapshots written)."""
        written, left = self._pages.persist(budget_s)
        return written, left, self._state.persist() if self._state is not None else 0

    # ---- reports and checks ----

    def stats(self) -> CacheStats:
        return self._pages.stats()

    def snapshot_stats(self) -> SnapshotStats | None:
        """The snapshot store's counters; None when no snapshots are kept (no state group, or --state-snapshots 0)."""
        if self._state is None or self._state.store.capacity == 0:
            return None
        return self._state.store.stats()

    def session_pages(self, session: str) -> dict[Tier, int]:
        return self._pages.session_pages(session)

    def session_summary(self, s: Session, generating: bool) -> SessionSummary:
        return session_summary(self._pages, s, generating, self._snapshot_bytes(s.id))

    def session_detail(self, s: Session, generating: bool) -> SessionDetail:
        return session_detail(self._pages, s, generating, self._snapshot_bytes(s.id))

    def _snapshot_bytes(self, session: str) -> int:
        return self._state.store.session_bytes(session) if self._state is not None else 0

    def running_pages(self, running: Sequence[SeqCache]) -> int:
        return len({p for h in running for p in h.pages})

    def check_integrity(self, running: Sequence[SeqCache]) -> None:
        self._pages.check_integrity(Counter(p for h in running for p in h.pages))

    @contextmanager
    def scratch(self, num_tokens: int) -> Iterator[SeqCache]:
        """Pages and a row for a one-off computation outside the cache (LLM.logits), given back after."""
        need = -(-num_tokens // self.ps)
        pages = self._pages.reserve(need)
        if pages is None:
            raise RuntimeError(f"no room for {num_tokens} scratch tokens in the KV pool")
        h = SeqCache(pages, self._rows.take(None))
        try:
            yield h
        finally:
            self._pages.release(h.pages)
            self._rows.give_back(h.row)


def build_cache(config: EngineConfig, shape: CacheShape, clock: Callable[[], float] = time.monotonic) -> CacheManager:
    """The engine's cache for its config and what the runner allotted: the page policy with its tiers, the rows,
    and the state group with its snapshots (on the disk tier too) when the model has one."""
    pool = PagePool(shape.num_pages, shape.page_size)
    pages = kv_manager(config, pool, shape.kv, clock, state=shape.state)
    state = None
    if shape.state is not None:
        # rings (in place) hold a page of slack: their snapshots resume a page back too
        store = SnapshotStore(shape.num_rows, shape.num_snapshots, shape.state.slot_bytes(), shape.state_in_place,
                              shape.num_host_snapshots, shape.page_size if shape.state_in_place else 0)
        if shape.num_snapshots > 0:
            pages.keep_states(store)
        tier = pages.disk.tier if pages.disk is not None else None
        state = StateGroupCache(store, disk_states(tier, shape.state, store if shape.num_snapshots > 0 else None,
                                                   shape.page_size), shape.page_size)
    return CacheManager(pages, RowPool(shape.num_rows), state)
