"""`RadixTree`: the radix cache's tree itself (radix_cache.py is the cache API over it): the nodes
(radix_node.py) under a root, the pages they own on each tier, the epoch that makes a `Match` from before a
change stale, and the mechanics that change the tree's shape (`split`, `attach`, `remove`) or a node's tier
(`retier`). `locked` says whether a running request holds a node. The evictor (radix_evict.Tree) and the disk
tier (radix_disk.py) call back through these.

Tree shape: children are keyed by their first page of tokens, so siblings differ in the first page. The GPU
nodes form a top-down closed subtree: a GPU node's parent is a GPU node or the root; demotion goes leaf-first
and promotion top-down, so a path is always "GPU prefix, then host suffix". `lock` splits the last node at
the match boundary, so a request's references always cover whole nodes.
"""

from __future__ import annotations

from agentbox.engine.cache.host_tier import HostTier
from agentbox.engine.cache.kv_pool import PagePool
from agentbox.engine.cache.page_cache import PageCache
from agentbox.engine.cache.radix_node import Match, Node, Tier
from agentbox.engine.cache.session_index import SessionIndex
from agentbox.engine.cache.turns import Turns
from agentbox.layers.backends.base import KVCache


class RadixTree(PageCache):
    """The tree's shape, tiers and page counts; `RadixCache` (radix_cache.py) adds lookup, lock and insert."""

    def __init__(self, pool: PagePool, turns: Turns, kv: KVCache | None, host: HostTier | None) -> None:
        super().__init__(pool, turns)
        self.kv = kv
        self.host = host
        self.ps = pool.page_size
        self.root = Node((), [], Tier.GPU, None, 0)
        self.index = SessionIndex(self.turns)
        self._epoch = 0  # bumped on every change of the tree's shape or tiers: a Match from before is stale
        self.gpu_pages = 0
        self.host_pages = 0

    def attach(self, parent: Node, tokens: tuple[int, ...], pages: list[int]) -> Node:
        """A new device node under parent holding `tokens` on `pages` (read back from a slower tier: the tree
        takes the caller's reference on them)."""
        node = Node(tokens, pages, Tier.GPU, parent, parent.start + len(parent.key))
        parent.children[tokens[: self.ps]] = node
        self.gpu_pages += len(pages)
        self._epoch += 1
        return node

    def kv_of(self, n: Node) -> KVCache:
        if n.tier is Tier.GPU:
            assert self.kv is not None
            return self.kv
        assert self.host is not None
        return self.host.kv

    def _check_fresh(self, m: Match) -> None:
        if m.epoch != self._epoch:
            raise ValueError("a stale Match: the tree changed since the lookup; match again")

    def _gpu_prefix_pages(self, m: Match) -> list[int]:
        out: list[int] = []
        for n in m.path:
            if n.tier is not Tier.GPU:
                break
            out += n.pages[: min(len(n.key), m.num_tokens - n.start) // self.ps]
        return out

    # ---- tree mechanics (`remove`, `retier` and `locked` are also the evictor's view: radix_evict.Tree) ----

    def split(self, n: Node, m: int) -> Node:
        """Cut n after m tokens (page-aligned, 0 < m < len); returns the new prefix node (n keeps the rest)."""
        k = m // self.ps
        parent = n.parent
        assert parent is not None and 0 < m < len(n.key) and m % self.ps == 0
        first = n.key[: self.ps]
        head, ids = n.split_at(m)
        pre = Node(head, n.pages[:k], n.tier, parent, n.start, ids)
        pre.sessions = set(n.sessions)
        pre.last_access = n.last_access
        parent.children[first] = pre
        n.pages, n.start, n.parent = n.pages[k:], n.start + m, pre
        pre.children[n.key[: self.ps]] = n
        self.index.split(pre)
        self._epoch += 1
        return pre

    def remove(self, n: Node) -> None:
        """Detach n (no children, unlocked) and drop the tree's reference on its pages."""
        if self.locked(n):
            raise RuntimeError("removing a node a request still holds")
        parent = n.parent
        assert parent is not None
        del parent.children[n.key[: self.ps]]
        self._pool_of(n.tier).decref(n.pages)
        self._count(n, -1)
        self.index.removed(n)
        self._epoch += 1
        n.alive = False
        n.version += 1

    def retier(self, n: Node, pages: list[int], tier: Tier) -> None:
        """n's tokens now live on `pages` of `tier`: the caller copied them and settled the old pages'
        references. Its heap entries and every Match go stale."""
        self._count(n, -1)
        n.pages, n.tier = pages, tier
        self._count(n, 1)
        n.version += 1
        self._epoch += 1

    def locked(self, n: Node) -> bool:
        """A running request holds a reference on one of n's pages (so n is never evicted, demoted or dropped)."""
        rc = self._pool_of(n.tier).refcount
        return any(rc[p] > 1 for p in n.pages)

    def _pool_of(self, tier: Tier) -> PagePool:
        if tier is Tier.GPU:
            return self.pool
        assert self.host is not None
        return self.host.pool

    def _count(self, n: Node, sign: int) -> None:
        if n.tier is Tier.GPU:
            self.gpu_pages += sign * len(n.pages)
        else:
            self.host_pages += sign * len(n.pages)
