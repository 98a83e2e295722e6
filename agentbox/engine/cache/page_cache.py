"""`PageCache`: the paged half of the cache, the contract every page policy implements (cache_policies.py; the
radix tree they share: radix_cache.py). The scheduler and the core never see it: they use `CacheManager`
(manager.py), which composes it with the model's state group and hands out the requests' cache handles.

The contract:

Entries. The cache holds entries keyed by page-aligned token prefixes. An entry is what a prefix's owner
needs to skip computing it: today its KV pages on one tier. It may carry more: an implementation can attach
other state to an entry (a model with recurrent layers needs a snapshot of that state at the entry's last
token), and then `match` returns the longest prefix *it can resume from* (for that model: whose last entry
carries a snapshot), not merely the longest one with pages; `insert` is where the caller hands such state
over with the pages, and the `Lock` is where it gets it back. Dropping or moving an entry takes all it
carries. Callers read only `Match`/`Lock`, never entries.

Tiers. An entry lives on one tier: the device pool (`Tier.GPU`) or a slower one below it (`Tier.HOST`,
then `Tier.DISK`, radix_disk.py). A matched path is always "device prefix, then slower tiers in order"; `lock`
brings every slower part up into fresh device pages (so the caller only ever sees device pages; `Match` and
`Lock` say only how many tokens were copied in, never from where) and `evict` moves entries down a tier before
it drops them. A new tier is an implementation detail of `match`, `lock`, `evict`, `reclaimable` and `stats`:
nothing a caller does changes.

Look, then take:
- `match(tokens, session, namespace)` is pure: the longest usable cached prefix and the session (given, else
  inferred from the cache). Nothing held, nothing moved: looking and declining leaves nothing to undo.
- `reclaimable(match)` (pure): GPU pages the caller could have after locking the match (free pages plus
  everything eviction can free without touching the match or another request's lock).
- `lock(match)` commits: the caller gets its own reference on every GPU page of the prefix (slower tiers
  promoted first), the session is tagged on it and its lease refreshed. A match from before any change to
  the cache is refused (`ValueError`): match again.
- `reserve(n)`: n fresh GPU pages for the caller, evicting for them; None when eviction cannot free them.
- `insert(tokens, pages, session)` hands the computed full pages back (they become entries; the caller's
  references are consumed); `release(pages)` drops the caller's references on pages it will not insert.

Sessions. The turn lifecycle goes through here (the session table's one writer is `Turns`, turns.py):
`begin_turn` at a request's first admission (the session id is decided there: session_ids.py), `first_token`,
`complete_turn`, `end_turn` (after its pages are inserted), `forget_session`. Admission of a request that
starts a new session asks `admits_new_session` when the policy `gates_new_sessions`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from agentbox.config import CachePolicy
from agentbox.engine.cache.kv_pool import PagePool
from agentbox.engine.cache.radix_node import Lock, Match, Tier
from agentbox.engine.cache.session_ids import SessionIds
from agentbox.engine.cache.sessions import SessionTable, TurnRecord
from agentbox.engine.cache.stats import CacheStats
from agentbox.engine.cache.turns import Turns

if TYPE_CHECKING:
    from agentbox.engine.cache.state_units import StatePoints


@dataclass(frozen=True)
class TurnStart:
    """What a request's first admission settled: its session and what it is told of the cache."""

    session: str
    cached_tokens: int  # reported to the client (under API-key namespaces, only its own key's prefixes)
    host_cached_tokens: int  # of those, copied back from a slower tier (host RAM or disk)
    recomputed_tokens: int  # the session's history the cache had lost and that is computed again


class PageCache(ABC):
    policy: ClassVar[CachePolicy]
    gates_new_sessions: ClassVar[bool] = False  # new sessions wait at the door for room (the session policy)
    caches_completions: ClassVar[bool] = True  # a finished answer's last token is computed to be cached

    def __init__(self, pool: PagePool, turns: Turns) -> None:
        self.pool = pool  # the GPU pool: callers read its sizes (capacity, num_free, page_size), never write it
        self.turns = turns
        self.ids = SessionIds(turns.table)

    @property
    def sessions(self) -> SessionTable:
        """The session table, to read (the sessions endpoints, tests). Writes go through `Turns`."""
        return self.turns.table

    @property
    def clock(self) -> Callable[[], float]:
        return self.turns.clock

    # ---- look, then take ----

    @abstractmethod
    def match(self, tokens: Sequence[int], session: str | None = None, namespace: str = "",
              end: int | None = None) -> Match: ...

    def prefetch(self, tokens: Sequence[int], session: str | None = None, namespace: str = "",
                 end: int | None = None) -> None:
        """A request for tokens[:end] arrived: start bringing up what a slower tier holds of its prefix (in the
        background: nothing in the cache changes). A no-op without such a tier."""
        return

    @abstractmethod
    def visible_tokens(self, m: Match, namespace: str) -> int:
        """Of m's tokens, those a request of `namespace` may be told are cached. Pure."""

    @abstractmethod
    def reclaimable(self, m: Match) -> int: ...

    @abstractmethod
    def lock(self, m: Match) -> Lock: ...

    @abstractmethod
    def insert(self, tokens: Sequence[int], pages: list[int], session: str | None = None) -> None: ...

    @abstractmethod
    def evict(self, num_pages: int) -> int:
        """Free at least num_pages GPU pages if possible (moving entries down a tier first). Returns pages freed."""

    def reserve(self, num_pages: int) -> list[int] | None:
        """num_pages fresh GPU pages (one reference each for the caller), evicting for them; None if they
        cannot be had (nothing is taken then)."""
        if self.pool.num_free < num_pages:
            self.evict(num_pages - self.pool.num_free)
        if self.pool.num_free < num_pages:
            return None
        return self.pool.alloc(num_pages)

    @abstractmethod
    def keep_states(self, points: StatePoints) -> None:
        """A hybrid model's snapshot store: eviction takes snapshots and the pages they resume on together
        (state_units.py). Without one, pages are evicted alone."""

    def release(self, pages: list[int]) -> None:
        """Drop the caller's references on pages it will not insert (an abort, a partial last page)."""
        self.pool.decref(pages)

    # ---- admission ----

    def admits_new_session(self, need_pages: int, held_pages: int) -> bool:
        """A new session needing need_pages fits beside running requests holding held_pages and the leases
        the policy keeps. Only asked when `gates_new_sessions`."""
        return True

    def knows(self, session: str | None) -> bool:
        """A session the cache has seen (its request is a return, not a new session)."""
        return session is not None and session in self.turns.table

    # ---- the turn lifecycle ----

    def begin_turn(self, given: str | None, lock: Lock, namespace: str, prompt: Sequence[int],
                   shown: int | None = None) -> TurnStart:
        """A request's first admission, on its locked prefix: its session is decided, its turn begins (the
        gap since the session's last turn ends here) and its prompt is counted. `shown`: the tokens it may
        be told are cached (under API-key namespaces, only its own key's prefixes)."""
        sid = self.ids.decide(lock.session if given is None else given, namespace)
        cached = lock.num_tokens if shown is None else min(shown, lock.num_tokens)
        host = min(lock.num_copied_tokens, cached)
        recomputed = self.turns.begin(sid, prompt, cached, host, self.pool.page_size)
        return TurnStart(sid, cached, host, recomputed)

    def first_token(self, session: str, ttft_s: float, record: TurnRecord) -> None:
        self.turns.first_token(session, ttft_s, record)

    def complete_turn(self, session: str, completion_tokens: int) -> None:
        self.turns.complete(session, completion_tokens)

    def end_turn(self, session: str) -> None:
        """The turn is done and its pages inserted: the lease runs a fresh TTL, eviction keys follow it."""
        self.turns.end(session)

    def persist(self, budget_s: float) -> tuple[int, int]:
        """A graceful stop: write what the disk tier lacks (pages, sessions) within budget_s. Returns (pages
        written, pages left unwritten); (0, 0) without a disk tier."""
        return 0, 0

    @abstractmethod
    def drop_session(self, session: str) -> int:
        """Forget a session and free the entries only it used. Returns pages freed (all tiers)."""

    def forget_session(self, session: str) -> int:
        freed = self.drop_session(session)
        self.turns.forget(session)
        return freed

    # ---- reports and checks ----

    @abstractmethod
    def stats(self) -> CacheStats: ...

    @abstractmethod
    def session_pages(self, session: str) -> dict[Tier, int]: ...

    @abstractmethod
    def check_integrity(self, running_refs: Counter[int] | None = None) -> None: ...
