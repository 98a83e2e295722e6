"""Eviction, demotion and promotion for the radix cache (radix_tree.py has the tree, radix_cache.py the
lookup/lock contract and the reference discipline): which leaf leaves next, and moving a node's pages between the
tiers. The `Evictor` sees its cache only through `Tree`, the few members it needs: the pools, the page counts,
`locked`, `eviction_key` (the policy's order), and the two tree mutations eviction makes (`remove` a node, `retier`
its pages).

Eviction (`evict(n)`): GPU leaves (nodes without GPU children) leave in priority-class order through an
incremental heap with lazy invalidation (a node's `version` is bumped on each push; stale entries are
skipped; a popped key is recomputed and the node re-pushed if it has grown past the next entry's — keys
only grow with time except at lease expiry and turn end, where the session's leaves are re-pushed):
  class 0: no live or expired lease on any session tagging the node; least recently used first.
  class 1: the best lease among its sessions has expired; earliest expiry first.
  class 2: a live lease; lowest expected saving per page-second first: the recompute cost of its tokens
           (tokens x (1 + mean position / ATTN_TOKENS), attention grows with depth; evict_order.py) divided by its pages x
           the time until the session's expected return (last turn end + median gap).
The classes are the session policy's (`SessionCache.eviction_key`); under lru every node is class 0. With a
host tier an evicted GPU node is copied to host (making room by dropping host LRU leaves) instead of dropped;
host nodes on a matched path are promoted back (allocate GPU pages, copy) instead of being recomputed. A
locked node (any page above refcount 1) is skipped and re-pushed: it is never evicted, demoted or dropped.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator
from typing import Protocol

from agentbox.engine.cache.host_tier import HostTier, copy_pages
from agentbox.engine.cache.kv_pool import PagePool
from agentbox.engine.cache.radix_node import Node, Tier
from agentbox.engine.cache.session_index import SessionIndex
from agentbox.engine.cache.state_units import StatePoints, drop_host_unit, evict_unit
from agentbox.layers.backends.base import KVCache

HeapEntry = tuple[tuple[int, float], int, int, Node]  # (key, push order, node version at push, node)


class Tree(Protocol):
    """What the evictor needs of the cache it serves (RadixCache)."""

    pool: PagePool
    kv: KVCache | None
    host: HostTier | None
    index: SessionIndex
    root: Node
    gpu_pages: int
    host_pages: int

    @property
    def clock(self) -> Callable[[], float]: ...

    def locked(self, n: Node) -> bool: ...

    def eviction_key(self, n: Node, now: float) -> tuple[int, float]: ...

    def remove(self, n: Node) -> None: ...

    def retier(self, n: Node, pages: list[int], tier: Tier) -> None: ...

    def spill(self, n: Node) -> None: ...

    def split(self, n: Node, m: int) -> Node: ...


def _valid(n: Node, version: int, tier: Tier) -> bool:
    return n.alive and n.version == version and n.tier is tier


class Evictor:
    """One cache's two leaf heaps (GPU, host) and the moves that empty them; counts every page it moves."""

    def __init__(self, tree: Tree) -> None:
        self.tree = tree
        self.gpu_heap: list[HeapEntry] = []
        self.host_heap: list[HeapEntry] = []
        self._seq = itertools.count()
        self.evictions = 0  # GPU pages dropped (not demoted)
        self.demotions = 0  # GPU pages copied to host
        self.promotions = 0  # host pages copied back to GPU
        self.host_evictions = 0  # host pages dropped
        # Hybrid models: the recurrent-state snapshots that pages resume (state_units.py); None: pages alone.
        self.states: StatePoints | None = None

    def evict(self, num_pages: int) -> int:
        """Free at least num_pages GPU pages if possible (demoting to host where it has room). Returns the
        number of GPU pages freed."""
        if num_pages <= 0:
            return 0
        t = self.tree
        now = t.clock()
        for sid in t.index.expired(now):
            self.repush_session(sid)
        freed = 0
        held: list[Node] = []
        while freed < num_pages and self.gpu_heap:
            key, _, version, n = heapq.heappop(self.gpu_heap)
            if not _valid(n, version, Tier.GPU) or not n.is_gpu_leaf():
                continue
            if t.locked(n):
                held.append(n)
                continue
            cur = t.eviction_key(n, now)
            if cur > key and self.gpu_heap and cur > self.gpu_heap[0][0]:
                self._push(n, self.gpu_heap, cur)
                continue
            freed += self.evict_node(n) if self.states is None else evict_unit(self, n, self.states)
        for n in held:
            self.push_candidate(n)
        return freed

    def evict_node(self, n: Node) -> int:
        t = self.tree
        k = len(n.pages)
        parent = n.parent
        assert parent is not None
        if t.host is not None and self._make_host_room(k):
            assert t.kv is not None
            host_pages = t.host.pool.alloc(k)
            copy_pages(t.kv, n.pages, t.host.kv, host_pages)
            t.pool.decref(n.pages)
            t.retier(n, host_pages, Tier.HOST)  # its GPU heap entries are stale now
            self.demotions += k
            self.push_candidate(n)
        else:
            self.drop_subtree(n)
            self.evictions += k
        self.push_candidate(parent)
        return k

    def drop_subtree(self, n: Node) -> None:
        for child in list(n.children.values()):
            self.drop_subtree(child)
            self.host_evictions += len(child.pages) if child.tier is Tier.HOST else 0
        self.tree.spill(n)
        self.tree.remove(n)

    def _make_host_room(self, k: int) -> bool:
        assert self.tree.host is not None
        hp = self.tree.host.pool
        if k > hp.capacity:
            return False
        if hp.num_free < k:
            self.evict_host(k - hp.num_free)
        return hp.num_free >= k

    def evict_host(self, num_pages: int) -> int:
        """Drop host leaves, least recently used first (the host tier is the last stop before recompute)."""
        freed = 0
        held: list[Node] = []
        while freed < num_pages and self.host_heap:
            _, _, version, n = heapq.heappop(self.host_heap)
            if not _valid(n, version, Tier.HOST) or n.children:
                continue
            if self.tree.locked(n):
                held.append(n)
                continue
            if self.states is not None:
                freed += drop_host_unit(self, n, self.states)
                continue
            parent = n.parent
            assert parent is not None
            freed += len(n.pages)
            self.host_evictions += len(n.pages)
            self.tree.spill(n)
            self.tree.remove(n)
            self.push_candidate(parent)
        for n in held:
            self.push_candidate(n)
        return freed

    def promote(self, n: Node) -> bool:
        """Copy a host node (carrying the caller's lock) back to fresh GPU pages, one extra ref for the caller."""
        t = self.tree
        assert t.host is not None and t.kv is not None
        k = len(n.pages)
        if t.pool.num_free < k:
            self.evict(k - t.pool.num_free)
        if t.pool.num_free < k:
            return False
        gpu = t.pool.alloc(k)
        copy_pages(t.host.kv, n.pages, t.kv, gpu)
        t.pool.incref(gpu)
        t.host.pool.decref(n.pages + n.pages)  # the caller's lock and the tree's reference
        t.retier(n, gpu, Tier.GPU)
        self.promotions += k
        return True

    def demote(self, num_pages: int) -> int:
        """Move at least num_pages of unlocked GPU leaves to host now (e.g. ahead of a burst). Returns pages
        moved; 0 without a host tier."""
        if self.tree.host is None:
            return 0
        before = self.demotions
        self.evict(num_pages)
        return self.demotions - before

    # ---- the heaps ----

    def _push(self, n: Node, heap: list[HeapEntry], key: tuple[int, float]) -> None:
        n.version += 1
        heapq.heappush(heap, (key, next(self._seq), n.version, n))
        if len(heap) > 4 * (self.tree.gpu_pages + self.tree.host_pages) + 64:
            # Stale entries pile up when nothing is evicted for a while: drop them (amortized O(1)).
            tier = Tier.GPU if heap is self.gpu_heap else Tier.HOST
            heap[:] = [e for e in heap if _valid(e[3], e[2], tier)]
            heapq.heapify(heap)

    def push_candidate(self, n: Node) -> None:
        """(Re)enter n in the heap of its tier if it is a leaf there; stale entries die by version."""
        if n is self.tree.root or not n.alive:
            return
        t = self.tree
        if n.is_gpu_leaf():
            self._push(n, self.gpu_heap, t.eviction_key(n, t.clock()))
        elif n.is_host_leaf():
            self._push(n, self.host_heap, (0, n.last_access))

    def repush_session(self, sid: str) -> None:
        """A session's lease moved (refresh, turn end, expiry, cap): its leaves' keys move with it."""
        for n in self.tree.index.of(sid):
            self.push_candidate(n)

    def queued(self) -> Iterator[Node]:
        """Nodes with a live entry in the heap of their tier (for the integrity check)."""
        yield from (e[3] for e in self.gpu_heap if _valid(e[3], e[2], Tier.GPU))
        yield from (e[3] for e in self.host_heap if _valid(e[3], e[2], Tier.HOST))
