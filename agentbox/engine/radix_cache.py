"""The radix prefix cache: a tree over page-aligned token prefixes whose nodes own pages of the GPU pool
(or, once demoted, of the host tier). Tokens after the last full page are never cached.

Look up, then lock (mini-sglang's `match_prefix` / `lock_handle` contract):
- `match(tokens, session)` is a pure lookup. It returns a `Match` (radix_node.py) naming the longest cached
  page-aligned prefix: its nodes, its tokens on each tier, the session (given, or inferred from the tags).
  It changes nothing: no reference, no split, no tag, no lease refresh, no promotion, no access time, no heap
  entry. Looking and then declining (an admission that does not fit) leaves nothing to undo.
- `reclaimable(match)` (pure) is how many GPU pages the caller could have after locking the match: the free
  pages plus every tree page eviction can free without touching the match or another request's lock.
  An admission checks its need against it before it locks anything.
- `lock(match)` commits: it splits the last node at the match boundary (so a lock covers whole nodes),
  gives the caller a reference on every GPU page, promotes the host nodes (copies them back, evicting for
  room), tags the session on the path, refreshes its lease and the nodes' access times. It returns a
  `Lock` with the caller's pages. A match describes the tree as it was: after any change to the tree's shape
  or tiers (an epoch counter) `lock` refuses it, and the caller looks again.

Reference discipline (the whole correctness argument):
- The tree holds exactly one reference on every page a node owns (GPU pool or host pool).
- `lock` gives the caller its own reference on every page of the prefix. The caller drops it through
  `insert` (which consumes the caller's references on the pages it is given: new nodes keep them, pages
  whose prefix the tree already has are decref'd) or `release` (abort).
- So a page with refcount 1 is held only by the tree: evictable. A node with any page above 1 is locked by a
  running request and is never evicted, demoted or dropped. A lock covers a whole path from the root, so
  the locked nodes are closed under "parent of", every page with refcount above 1 is a tree page, and
  every other GPU tree page can be freed leaf-first: `reclaimable` is exact, free + gpu_pages -
  pool.num_shared - the match's GPU pages not yet shared.
- Host pages carry a reference for the caller only inside `lock`, while they are being promoted.

Tree shape: children are keyed by their first page of tokens, so siblings differ in the first page. The GPU
nodes form a top-down closed subtree: a GPU node's parent is a GPU node or the root; demotion goes leaf-first
and promotion top-down, so a path is always "GPU prefix, then host suffix". `lock` splits the last node at
the match boundary, so a request's references always cover whole nodes.

Eviction (`evict(n)`): GPU leaves (nodes without GPU children) leave in priority-class order through an
incremental heap with lazy invalidation (a node's `version` is bumped on each push; stale entries are
skipped; a popped key is recomputed and the node re-pushed if it has grown past the next entry's — keys
only grow with time except at lease expiry and turn end, where the session's leaves are re-pushed):
  class 0: no live or expired lease on any session tagging the node; least recently used first.
  class 1: the best lease among its sessions has expired; earliest expiry first.
  class 2: a live lease; lowest expected saving per page-second first: the recompute cost of its tokens
           (tokens x (1 + mean position / ATTN_TOKENS), attention grows with depth; evict_order.py) divided by its pages x
           the time until the session's expected return (last turn end + median gap).
Under `CachePolicy.LRU` every node is class 0; under `NONE` nothing is cached. With a host tier an evicted
GPU node is copied to host (making room by dropping host LRU leaves) instead of dropped; host nodes on a
matched path are promoted back (allocate GPU pages, copy) instead of being recomputed.

Sessions are tags: every node on a path a session locked or inserted carries its id (so a child's tags
are a subset of its parent's). `drop_session` removes the session's own suffix; shared prefixes survive. The per-session
bookkeeping (tags, lease expiries, the lease cap) is session_index.py.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import Counter
from collections.abc import Callable, Sequence

from agentbox.config import CachePolicy, EngineConfig
from agentbox.engine.evict_order import gpu_key
from agentbox.engine.host_tier import HostTier, copy_pages
from agentbox.engine.kv_pool import PagePool
from agentbox.engine.messages import CacheStats
from agentbox.engine.radix_check import check_integrity
from agentbox.engine.radix_node import Lock, Match, Node, Tier
from agentbox.engine.session_index import SessionIndex
from agentbox.engine.sessions import SessionTable
from agentbox.layers.backends.base import KVCache

_Entry = tuple[tuple[int, float], int, int, Node]


class RadixCache:
    def __init__(
        self,
        pool: PagePool,
        kv: KVCache | None = None,
        sessions: SessionTable | None = None,
        host: HostTier | None = None,
        policy: CachePolicy = CachePolicy.SESSION,
    ) -> None:
        policy = CachePolicy(policy)
        if host is not None and (kv is None or host.pool.page_size != pool.page_size):
            raise ValueError("a host tier needs the GPU KVCache and the same page size")
        self.pool = pool
        self.kv = kv
        self.sessions = sessions if sessions is not None else SessionTable()
        self.host = host if policy is not CachePolicy.NONE else None
        self.policy = policy
        self.ps = pool.page_size
        self.root = Node((), [], Tier.GPU, None, 0)
        self._gpu_heap: list[_Entry] = []
        self._host_heap: list[_Entry] = []
        self.index = SessionIndex(self.sessions, policy)
        self._seq = itertools.count()
        self._epoch = 0  # bumped on every change of the tree's shape or tiers: a Match from before is stale
        self.gpu_pages = 0
        self.host_pages = 0
        self.evictions = 0  # GPU pages dropped (not demoted)
        self.demotions = 0  # GPU pages copied to host
        self.promotions = 0  # host pages copied back to GPU
        self.host_evictions = 0  # host pages dropped

    @classmethod
    def from_config(
        cls, config: EngineConfig, pool: PagePool, kv: KVCache, clock: Callable[[], float] = time.monotonic
    ) -> RadixCache:
        """The engine's cache. The host tier belongs to the session policy; lru mirrors general engines."""
        host = HostTier.sized(kv, config.host_cache_gb) if config.cache_policy is CachePolicy.SESSION else None
        return cls(pool, kv, SessionTable.from_config(config, clock), host, config.cache_policy)

    @property
    def clock(self) -> Callable[[], float]:
        return self.sessions.clock

    # ---- lookup and insert ----

    def match(self, tokens: Sequence[int], session: str | None = None) -> Match:
        """The longest cached page-aligned prefix of tokens, and the session (given, else inferred). Pure."""
        if self.policy is CachePolicy.NONE:
            return Match((), 0, 0, session, self._epoch)
        toks = tuple(tokens[: len(tokens) // self.ps * self.ps])
        path: list[Node] = []
        node, i, host = self.root, 0, 0
        while i < len(toks):
            child = node.children.get(toks[i : i + self.ps])
            if child is None:
                break
            m = self._common(child.key, toks, i)  # >= one page: children are keyed by their first page
            path.append(child)
            i += m
            host += m if child.tier is Tier.HOST else 0
            if m < len(child.key):
                break
            node = child
        sid = session if session is not None else self.sessions.infer_session(path[-1] if path else None, i)
        return Match(tuple(path), i, host, sid, self._epoch)

    def reclaimable(self, m: Match) -> int:
        """GPU pages the caller could have after locking m: free pages, plus the unlocked tree pages outside
        m's GPU prefix (eviction frees them all, leaf-first; promoting m's host part uses pages of this
        count). Pure."""
        self._check_fresh(m)
        rc = self.pool.refcount
        mine = sum(1 for p in self._gpu_prefix_pages(m) if rc[p] == 1)
        return self.pool.num_free + self.gpu_pages - self.pool.num_shared - mine

    def lock(self, m: Match) -> Lock:
        """Commit a lookup: the caller's reference on each GPU page of the prefix (host parts promoted first),
        the session tagged on the path and its lease refreshed. Host parts that cannot be promoted for lack of
        GPU pages are left out (a shorter lock); `reclaimable` tells the caller beforehand."""
        self._check_fresh(m)
        if not m.path:
            return Lock([], 0, 0, m.session)
        path = list(m.path)
        last = path[-1]
        if last.start + len(last.key) > m.num_tokens:
            path[-1] = self._split(last, m.num_tokens - last.start)
        n_gpu = next((j for j, n in enumerate(path) if n.tier is Tier.HOST), len(path))
        pages = [p for n in path[:n_gpu] for p in n.pages]
        self.pool.incref(pages)
        host_nodes = path[n_gpu:]
        host_tokens = 0
        if host_nodes:
            assert self.host is not None
            self.host.pool.incref([p for n in host_nodes for p in n.pages])  # no host eviction under us
            for j, n in enumerate(host_nodes):
                if not self._promote(n):
                    self.host.pool.decref([p for m_ in host_nodes[j:] for p in m_.pages])
                    path = path[: n_gpu + j]
                    break
                pages += n.pages
                host_tokens += len(n.key)
        sid = m.session
        now = self.clock()
        if path and sid is not None:
            self.index.tag(path, sid)
            self.index.refreshed(sid)
        for n in path:
            n.last_access = now
            self._push_candidate(n)
        return Lock(pages, len(pages) * self.ps, host_tokens, sid)

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

    def insert(self, tokens: Sequence[int], pages: list[int], session: str | None = None) -> None:
        """Cache tokens[:n * page_size] on pages[:n], n = len(tokens) // page_size; pages[n:] stay the
        caller's. Consumes the caller's reference on pages[:n]. Grants / refreshes the session's lease."""
        n = len(tokens) // self.ps
        if len(pages) < n:
            raise ValueError(f"{n} full pages of tokens but only {len(pages)} pages")
        pages = pages[:n]
        toks = tuple(tokens[: n * self.ps])
        if session is not None:  # the session computed these, whether or not the policy keeps them
            self.sessions.record_history(session, toks, self.ps)
        if self.policy is CachePolicy.NONE:
            self.pool.decref(pages)
            return
        now = self.clock()
        path: list[Node] = []
        node, i = self.root, 0
        while i < len(toks):
            pi = i // self.ps
            child = node.children.get(toks[i : i + self.ps])
            if child is None:
                child = Node(toks[i:], list(pages[pi:]), Tier.GPU, node, i)
                node.children[toks[i : i + self.ps]] = child
                self._epoch += 1
                self.gpu_pages += len(child.pages)
                path.append(child)
                break
            m = self._common(child.key, toks, i)
            if m < len(child.key):
                child = self._split(child, m)
            mine = pages[pi : pi + m // self.ps]
            if child.tier is Tier.GPU:
                self.pool.decref(mine)  # the tree has these tokens: drop the caller's (duplicate) reference
            else:
                # The tree kept these on host; the caller's fresh GPU pages are better than a copy back.
                assert self.host is not None
                self.host.pool.decref(child.pages)
                self.host_pages -= len(child.pages)
                self.gpu_pages += len(mine)
                child.pages, child.tier = list(mine), Tier.GPU
                child.version += 1
                self._epoch += 1
            path.append(child)
            node, i = child, i + m
        if session is not None:
            self.index.tag(path, session)
            self.index.refreshed(session)
        for nd in path:
            nd.last_access = now
            self._push_candidate(nd)
        if session is not None:
            self._enforce_cap()

    def release(self, pages: list[int]) -> None:
        """Drop the caller's references on locked pages it will not insert (abort)."""
        self.pool.decref(pages)

    def end_turn(self, session: str) -> None:
        """A session's turn is done: its lease runs a fresh TTL and its eviction keys move with it."""
        self.sessions.end_turn(session)
        self.index.refreshed(session)
        self._repush_session(session)
        self._enforce_cap()

    # ---- eviction, demotion, promotion ----

    def evict(self, num_pages: int) -> int:
        """Free at least num_pages GPU pages if possible (demoting to host where it has room). Returns the
        number of GPU pages freed."""
        if num_pages <= 0:
            return 0
        now = self.clock()
        for sid in self.index.expired(now):
            self._repush_session(sid)
        freed = 0
        held: list[Node] = []
        while freed < num_pages and self._gpu_heap:
            key, _, version, n = heapq.heappop(self._gpu_heap)
            if not self._valid(n, version, Tier.GPU) or not self._is_gpu_leaf(n):
                continue
            if self._locked(n):
                held.append(n)
                continue
            cur = gpu_key(n, self.sessions, self.policy, now)
            if cur > key and self._gpu_heap and cur > self._gpu_heap[0][0]:
                self._push(n, self._gpu_heap, cur)
                continue
            freed += self._evict_gpu_node(n)
        for n in held:
            self._push_candidate(n)
        return freed

    def _evict_gpu_node(self, n: Node) -> int:
        k = len(n.pages)
        parent = n.parent
        assert parent is not None
        if self.host is not None and self._make_host_room(k):
            assert self.kv is not None
            host_pages = self.host.pool.alloc(k)
            copy_pages(self.kv, n.pages, self.host.kv, host_pages)
            self.pool.decref(n.pages)
            n.pages, n.tier = host_pages, Tier.HOST
            self._epoch += 1
            self.gpu_pages -= k
            self.host_pages += k
            self.demotions += k
            n.version += 1  # its GPU heap entries are stale now
            self._push_candidate(n)
        else:
            self._drop_subtree(n)
            self.evictions += k
        self._push_candidate(parent)
        return k

    def _make_host_room(self, k: int) -> bool:
        assert self.host is not None
        hp = self.host.pool
        if k > hp.capacity:
            return False
        if hp.num_free < k:
            self.evict_host(k - hp.num_free)
        return hp.num_free >= k

    def evict_host(self, num_pages: int) -> int:
        """Drop host leaves, least recently used first (the host tier is the last stop before recompute)."""
        freed = 0
        held: list[Node] = []
        while freed < num_pages and self._host_heap:
            _, _, version, n = heapq.heappop(self._host_heap)
            if not self._valid(n, version, Tier.HOST) or n.children:
                continue
            if self._locked(n):
                held.append(n)
                continue
            parent = n.parent
            assert parent is not None
            freed += len(n.pages)
            self.host_evictions += len(n.pages)
            self._remove_node(n)
            self._push_candidate(parent)
        for n in held:
            self._push_candidate(n)
        return freed

    def _promote(self, n: Node) -> bool:
        """Copy a host node (carrying the caller's lock) back to fresh GPU pages, one extra ref for the caller."""
        assert self.host is not None and self.kv is not None
        k = len(n.pages)
        if self.pool.num_free < k:
            self.evict(k - self.pool.num_free)
        if self.pool.num_free < k:
            return False
        gpu = self.pool.alloc(k)
        copy_pages(self.host.kv, n.pages, self.kv, gpu)
        self.pool.incref(gpu)
        self.host.pool.decref(n.pages + n.pages)  # the caller's lock and the tree's reference
        n.pages, n.tier = gpu, Tier.GPU
        n.version += 1
        self._epoch += 1
        self.gpu_pages += k
        self.host_pages -= k
        self.promotions += k
        return True

    def demote(self, num_pages: int) -> int:
        """Move at least num_pages of unlocked GPU leaves to host now (e.g. ahead of a burst). Returns pages
        moved; 0 without a host tier."""
        if self.host is None:
            return 0
        before = self.demotions
        self.evict(num_pages)
        return self.demotions - before

    def drop_session(self, session: str) -> int:
        """Forget a session: untag its nodes and free those no other session uses and no request holds.
        Returns pages freed (both tiers)."""
        nodes = self.index.forget(session)
        freed = 0
        for n in sorted(nodes, key=lambda n: n.start, reverse=True):  # children before parents
            if not n.alive or n.sessions or n.children or self._locked(n):
                continue
            parent = n.parent
            assert parent is not None
            freed += len(n.pages)
            self._remove_node(n)
            self._push_candidate(parent)
        return freed

    def _enforce_cap(self) -> None:
        for sid in self.index.release_over_cap(self.pool.capacity):
            self._repush_session(sid)

    # ---- tree mechanics ----

    def _common(self, key: tuple[int, ...], toks: tuple[int, ...], i: int) -> int:
        """Whole pages (in tokens) on which key and toks[i:] agree."""
        n = min(len(key), len(toks) - i)
        if key[:n] == toks[i : i + n]:
            return n // self.ps * self.ps
        j = next(j for j in range(n) if key[j] != toks[i + j])
        return j // self.ps * self.ps

    def _split(self, n: Node, m: int) -> Node:
        """Cut n after m tokens (page-aligned, 0 < m < len); returns the new prefix node (n keeps the rest)."""
        k = m // self.ps
        parent = n.parent
        assert parent is not None and 0 < m < len(n.key) and m % self.ps == 0
        pre = Node(n.key[:m], n.pages[:k], n.tier, parent, n.start)
        pre.sessions = set(n.sessions)
        pre.last_access = n.last_access
        parent.children[n.key[: self.ps]] = pre
        n.key, n.pages, n.start, n.parent = n.key[m:], n.pages[k:], n.start + m, pre
        pre.children[n.key[: self.ps]] = n
        self.index.split(pre)
        self._epoch += 1
        return pre

    def _remove_node(self, n: Node) -> None:
        if self._locked(n):
            raise RuntimeError("removing a node a request still holds")
        parent = n.parent
        assert parent is not None
        del parent.children[n.key[: self.ps]]
        if n.tier is Tier.GPU:
            self.pool.decref(n.pages)
            self.gpu_pages -= len(n.pages)
        else:
            assert self.host is not None
            self.host.pool.decref(n.pages)
            self.host_pages -= len(n.pages)
        self.index.removed(n)
        self._epoch += 1
        n.alive = False
        n.version += 1

    def _drop_subtree(self, n: Node) -> None:
        for child in list(n.children.values()):
            self._drop_subtree(child)
            self.host_evictions += len(child.pages) if child.tier is Tier.HOST else 0
        self._remove_node(n)

    def _locked(self, n: Node) -> bool:
        if n.tier is Tier.GPU:
            rc = self.pool.refcount
        else:
            assert self.host is not None
            rc = self.host.pool.refcount
        return any(rc[p] > 1 for p in n.pages)

    def _is_gpu_leaf(self, n: Node) -> bool:
        return n.tier is Tier.GPU and all(c.tier is Tier.HOST for c in n.children.values())

    @staticmethod
    def _valid(n: Node, version: int, tier: Tier) -> bool:
        return n.alive and n.version == version and n.tier is tier

    def _push(self, n: Node, heap: list[_Entry], key: tuple[int, float]) -> None:
        n.version += 1
        heapq.heappush(heap, (key, next(self._seq), n.version, n))
        if len(heap) > 4 * (self.gpu_pages + self.host_pages) + 64:
            # Stale entries pile up when nothing is evicted for a while: drop them (amortized O(1)).
            tier = Tier.GPU if heap is self._gpu_heap else Tier.HOST
            heap[:] = [e for e in heap if self._valid(e[3], e[2], tier)]
            heapq.heapify(heap)

    def _push_candidate(self, n: Node) -> None:
        """(Re)enter n in the heap of its tier if it is a leaf there; stale entries die by version."""
        if n is self.root or not n.alive:
            return
        if self._is_gpu_leaf(n):
            self._push(n, self._gpu_heap, gpu_key(n, self.sessions, self.policy, self.clock()))
        elif n.tier is Tier.HOST and not n.children:
            self._push(n, self._host_heap, (0, n.last_access))

    def _repush_session(self, sid: str) -> None:
        for n in self.index.of(sid):
            self._push_candidate(n)

    # ---- counters and checks ----

    def stats(self) -> CacheStats:
        return CacheStats(
            policy=self.policy,
            gpu_pages=self.gpu_pages,
            host_pages=self.host_pages,
            host_total_pages=self.host.pool.capacity if self.host is not None else 0,
            leased_pages=self.index.leased_pages(),
            evictions=self.evictions,
            demotions=self.demotions,
            promotions=self.promotions,
            host_evictions=self.host_evictions,
            sessions=len(self.sessions),
            live_leases=len(self.sessions.live()),
        )

    def session_pages(self, session: str) -> dict[Tier, int]:
        return self.index.pages_by_tier(session)

    def check_integrity(self, running_refs: Counter[int] | None = None) -> None:
        check_integrity(self, running_refs)
