"""The cache policies, each a `PageCache` (page_cache.py) over the radix tree (radix_cache.py), saying only what
it changes; `kv_manager` picks the engine's from its config.

- `SessionCache` (`--cache-policy session`, the default): sessions hold soft leases on their pages, eviction
  goes by lease class and expected saving (evict_order.py), a host-RAM tier takes evicted pages, and a
  request that starts a new session waits at the door until running work and live leases leave it room.
- `LruCache` (`lru`): the same tree, least recently used out first, no door: what general engines do.
- `NoCache` (`none`): nothing is kept; every request computes its whole prompt (the baseline).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from agentbox.config import CachePolicy, EngineConfig
from agentbox.engine.cache.disk_setup import disk_link
from agentbox.engine.cache.evict_order import gpu_key
from agentbox.engine.cache.host_tier import HostTier
from agentbox.engine.cache.kv_pool import PagePool
from agentbox.engine.cache.radix_cache import RadixCache
from agentbox.engine.cache.radix_disk import DiskLink
from agentbox.engine.cache.radix_node import Match, Node
from agentbox.engine.cache.sessions import Session, SessionTable
from agentbox.layers.backends.base import KVCache
from agentbox.layers.recurrent_state import StateCache


class SessionCache(RadixCache):
    policy = CachePolicy.SESSION
    gates_new_sessions = True

    def eviction_key(self, n: Node, now: float) -> tuple[int, float]:
        return gpu_key(n, self.sessions, now)

    def leases_holding_pages(self) -> list[Session]:
        return self.sessions.live()

    def admits_new_session(self, need_pages: int, held_pages: int) -> bool:
        leased = self.index.leased_pages(self.leases_holding_pages())
        # Leased pages the host tier can take are not in the way: they are demoted (copied out, and back
        # on return) instead of holding a new session at the door.
        host_room = self.host.pool.num_free if self.host is not None else 0
        return need_pages <= self.pool.capacity - held_pages - max(0, leased - host_room)


class LruCache(RadixCache):
    policy = CachePolicy.LRU


class NoCache(RadixCache):
    policy = CachePolicy.NONE
    caches_completions = False  # nothing keeps the last token's KV: the answer ends with its last sample

    def __init__(self, pool: PagePool, kv: KVCache | None = None, sessions: SessionTable | None = None,
                 host: HostTier | None = None, disk: DiskLink | None = None) -> None:
        super().__init__(pool, kv, sessions, None, None)  # nothing to demote into

    def match(self, tokens: Sequence[int], session: str | None = None, namespace: str = "",
              end: int | None = None) -> Match:
        return Match((), 0, 0, session, self._epoch)

    def insert(self, tokens: Sequence[int], pages: list[int], session: str | None = None) -> None:
        n = len(tokens) // self.ps
        if len(pages) < n:
            raise ValueError(f"{n} full pages of tokens but only {len(pages)} pages")
        if session is not None:  # the session computed these, though nothing keeps them
            self.turns.history(session, tuple(tokens[: n * self.ps]), self.ps)
        self.pool.decref(pages[:n])


POLICIES: dict[CachePolicy, type[RadixCache]] = {
    CachePolicy.SESSION: SessionCache,
    CachePolicy.LRU: LruCache,
    CachePolicy.NONE: NoCache,
}


def cache_for(policy: CachePolicy | str, pool: PagePool, kv: KVCache | None = None,
              sessions: SessionTable | None = None, host: HostTier | None = None,
              disk: DiskLink | None = None) -> RadixCache:
    cls = POLICIES[CachePolicy(policy)]
    return cls(pool, kv, sessions, host) if disk is None else cls(pool, kv, sessions, host, disk)


def kv_manager(config: EngineConfig, pool: PagePool, kv: KVCache,
               clock: Callable[[], float] = time.monotonic, state: StateCache | None = None) -> RadixCache:
    """The engine's cache. The host and disk tiers belong to the session policy; lru mirrors general engines.
    `state`: a model's per-sequence state (its snapshots go to the same disk tier: disk_states.py)."""
    session = config.cache_policy is CachePolicy.SESSION
    host = HostTier.sized(kv, config.host_cache_gb) if session else None
    link = disk_link(config, kv, state) if session else None
    cache = cache_for(config.cache_policy, pool, kv, SessionTable.from_config(config, clock), host, link)
    if link is not None and config.disk_restore:
        cache.restore_sessions()
    return cache
