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

The tree itself (its shape, the pages on each tier, the epoch, `split` / `attach` / `remove` / `retier` /
`locked`) is `RadixTree` (radix_tree.py), which this class extends.

Eviction, demotion and promotion (`evict`, `evict_host`, `demote`; promotion inside `lock`) are an
`Evictor` (radix_evict.py, with the priority classes and the heaps): the cache tells it which nodes became
leaves and it calls back through a small `Tree` view (`locked`, `remove`, `retier`, `eviction_key`).

This is the tree the cache policies share; each policy is a subclass (cache_policies.py) that says what it
changes (the eviction key, which leases hold pages, whether anything is kept at all), and the scheduler and
the core see them only through `CacheManager` (manager.py), which composes a policy with the state group.

Sessions are tags: every node on a path a session locked or inserted carries its id (so a child's tags
are a subset of its parent's). `drop_session` removes the session's own suffix; shared prefixes survive. The per-session
bookkeeping (tags, lease expiries, the lease cap) is session_index.py.
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Sequence

from agentbox.engine.cache.host_tier import HostTier
from agentbox.engine.cache.kv_pool import PagePool
from agentbox.engine.cache.radix_check import check_integrity
from agentbox.engine.cache.radix_disk import DiskLink
from agentbox.engine.cache.radix_evict import Evictor, HeapEntry
from agentbox.engine.cache.radix_node import Lock, Match, Node, Tier, as_key
from agentbox.engine.cache.radix_tree import RadixTree
from agentbox.engine.cache.sessions import Session, SessionTable
from agentbox.engine.cache.state_units import StatePoints
from agentbox.engine.cache.stats import CacheStats
from agentbox.engine.cache.turns import Turns
from agentbox.layers.backends.base import KVCache


class RadixCache(RadixTree):
    """The cache API over the tree (radix_tree.py); a policy subclass (cache_policies.py) is what an engine runs."""

    def __init__(
        self,
        pool: PagePool,
        kv: KVCache | None = None,
        sessions: SessionTable | None = None,
        host: HostTier | None = None,
        disk: DiskLink | None = None,
    ) -> None:
        if host is not None and (kv is None or host.pool.page_size != pool.page_size):
            raise ValueError("a host tier needs the GPU KVCache and the same page size")
        if disk is not None and kv is None:
            raise ValueError("a disk tier needs the GPU KVCache")
        super().__init__(pool, Turns(sessions if sessions is not None else SessionTable()), kv, host)
        self.disk = disk  # the tier below memory (radix_disk.py), an object of its own
        self._hints: dict[str, Node] = {}  # session -> the deepest node its last sequence reached (a hint)
        self.evictor = Evictor(self)

    # ---- what a policy changes ----

    def eviction_key(self, n: Node, now: float) -> tuple[int, float]:
        """n's place in the GPU eviction order, smallest first out: least recently used first here."""
        return (0, n.last_access)

    def leases_holding_pages(self) -> list[Session]:
        """The sessions whose leases keep pages resident (counted against the cap): none here."""
        return []

    # The counters are the evictor's.
    @property
    def evictions(self) -> int:  # GPU pages dropped (not demoted)
        return self.evictor.evictions

    @property
    def demotions(self) -> int:  # GPU pages copied to host
        return self.evictor.demotions

    @property
    def promotions(self) -> int:  # host pages copied back to GPU
        return self.evictor.promotions

    @property
    def host_evictions(self) -> int:  # host pages dropped
        return self.evictor.host_evictions

    # ---- lookup and insert ----

    def visible_tokens(self, m: Match, namespace: str) -> int:
        """Of m's matched tokens, those on the path up to the deepest node a session of `namespace` tagged
        (computed or matched before): what a request of that namespace may be told is cached. Pure."""
        for node in reversed(m.path):
            if any(s.startswith(namespace) for s in node.sessions):
                return min(m.num_tokens, node.start + len(node.key))
        return 0

    def match(self, tokens: Sequence[int], session: str | None = None, namespace: str = "",
              end: int | None = None) -> Match:
        """The longest cached page-aligned prefix of tokens[:end], and the session (given, else inferred). Pure.
        A tuple or an int32 array (a prompt from the API process) is walked as it is, `end` bounding the walk: a
        121k-token prompt's slice and tuple copies cost ~0.3 ms each, and the scheduler's admission had three."""
        toks = tokens if isinstance(tokens, tuple | array) else tuple(tokens)
        stop = (len(toks) if end is None else max(0, min(end, len(toks)))) // self.ps * self.ps
        path = self._hinted_path(session, toks, stop)
        node = path[-1] if path else self.root
        i = node.start + len(node.key)
        host = sum(len(n.key) for n in path if n.tier is Tier.HOST)
        while i < stop:
            child = node.children.get(as_key(toks, i, i + self.ps))
            if child is None:
                break
            m = child.common_pages(toks, i, stop, self.ps)  # >= one page: children are keyed by their first page
            path.append(child)
            i += m
            host += m if child.tier is Tier.HOST else 0
            if m < len(child.key):
                break
            node = child
        sid = self.ids.lookup(session, path[-1] if path else None, i, namespace)
        if self.disk is None or i >= stop:
            return Match(tuple(path), i, host, sid, self._epoch)
        below, sid = self.disk.find(toks[:stop], i, sid, namespace)  # the walk goes on on disk
        if below is None:
            return Match(tuple(path), i, host, sid, self._epoch)
        d = below.num_tokens
        return Match(tuple(path), i + d, host + d, sid, self._epoch, below)

    def prefetch(self, tokens: Sequence[int], session: str | None = None, namespace: str = "",
                 end: int | None = None) -> None:
        """A request arrived: what its match has on disk is read in the background while it waits for
        admission (its restore then takes the bytes). Changes nothing in the tree."""
        if self.disk is not None and self.disk.tier.pages:
            m = self.match(tokens, session, namespace, end)
            if m.below is not None:
                self.disk.prefetch(m.below)

    def _hinted_path(self, session: str | None, toks: tuple[int, ...] | array, stop: int) -> list[Node]:
        """The path to the session's deepest node when toks run through all of it, else []: the walk resumes
        there, so an agent's next turn walks only its new part. Every key on the path is compared with toks
        (a C compare per node, no dict walk), so the result is the full walk's: siblings differ in their
        first page, so a root-to-node chain matching toks is the only one the walk could have taken."""
        n = self._hints.get(session) if session is not None else None
        if n is None or not n.alive or n.start + len(n.key) > stop:
            return []
        path: list[Node] = []
        while n is not self.root:
            if n is None or not n.found_at(toks):
                return []
            path.append(n)
            n = n.parent
        path.reverse()
        return path

    def _touch(self, path: Sequence[Node], session: str | None, now: float) -> None:
        """A path just locked or inserted: tagged to the session (its lease refreshed, its lookup hint moved to
        the path's end), and every node's recency renewed for the evictor."""
        if session is not None:
            if self.disk is not None:
                self.disk.returned(session)
            self.index.tag(path, session)
            self.index.refreshed(session)
            self._hint(session, path)
        for n in path:
            n.last_access = now
            self.evictor.push_candidate(n)

    def _hint(self, session: str | None, path: Sequence[Node]) -> None:
        """Remember the deepest node a session's sequence reached (the next lookup's starting point)."""
        if session is not None and path:
            self._hints[session] = path[-1]

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
        if not m.path and m.below is None:
            return Lock([], 0, 0, m.session)
        path = list(m.path)
        mem = m.num_tokens - (m.below.num_tokens if m.below is not None else 0)
        last = path[-1] if path else self.root
        if last.start + len(last.key) > mem:
            path[-1] = self.split(last, mem - last.start)
        n_gpu = next((j for j, n in enumerate(path) if n.tier is Tier.HOST), len(path))
        pages: list[int] = []
        for n in path[:n_gpu]:  # each node's list joined at C speed (a 128k-token path: 7.6k pages, 1 -> 0.05 ms)
            pages += n.pages
        self.pool.incref(pages)
        host_nodes = path[n_gpu:]
        copied = 0
        if host_nodes:
            assert self.host is not None
            self.host.pool.incref([p for n in host_nodes for p in n.pages])  # no host eviction under us
            for j, n in enumerate(host_nodes):
                if not self.evictor.promote(n):
                    self.host.pool.decref([p for m_ in host_nodes[j:] for p in m_.pages])
                    path = path[: n_gpu + j]
                    break
                pages += n.pages
                copied += len(n.key)
        if m.below is not None and self.disk is not None and len(pages) * self.ps == mem:
            node = self.disk.restore(self, path[-1] if path else self.root, m.below)
            if node is not None:
                path.append(node)
                self.pool.incref(node.pages)
                pages += node.pages
                copied += len(node.key)
        sid = m.session
        now = self.clock()
        self._touch(path, sid if path else None, now)
        return Lock(pages, len(pages) * self.ps, copied, sid)

    # ---- the disk tier (radix_disk.py) ----

    def spill(self, n: Node) -> None:
        """n's pages are about to leave memory for good: written to the disk tier first (if there is one)."""
        if self.disk is not None:
            self.disk.spill(n, self.kv_of(n))

    def persist(self, budget_s: float) -> tuple[int, int]:
        return self.disk.persist(self, budget_s) if self.disk is not None else (0, 0)

    def flush(self, budget_s: float) -> tuple[int, int]:
        """Write every node of the tree to the disk tier within budget_s (radix_disk.DiskLink.flush)."""
        return self.disk.flush(self, budget_s) if self.disk is not None else (0, 0)

    def restore_sessions(self) -> int:
        """The sessions saved at the last stop, back under their ids ("on disk" until they return)."""
        return self.disk.restore_sessions(self.turns) if self.disk is not None else 0

    def insert(self, tokens: Sequence[int], pages: list[int], session: str | None = None) -> None:
        """Cache tokens[:n * page_size] on pages[:n], n = len(tokens) // page_size; pages[n:] stay the
        caller's. Consumes the caller's reference on pages[:n]. Grants / refreshes the session's lease."""
        n = len(tokens) // self.ps
        if len(pages) < n:
            raise ValueError(f"{n} full pages of tokens but only {len(pages)} pages")
        pages = pages[:n]
        toks = tokens[: n * self.ps] if isinstance(tokens, array) else tuple(tokens[: n * self.ps])
        if session is not None:  # the session computed these
            self.turns.history(session, toks, self.ps)
        now = self.clock()
        path: list[Node] = []
        node, i = self.root, 0
        while i < len(toks):
            pi = i // self.ps
            child = node.children.get(as_key(toks, i, i + self.ps))
            if child is None:
                child = Node(as_key(toks, i, len(toks)), list(pages[pi:]), Tier.GPU, node, i,
                             toks[i:] if isinstance(toks, array) else None)
                node.children[child.key[: self.ps]] = child
                self._epoch += 1
                self.gpu_pages += len(child.pages)
                path.append(child)
                break
            m = child.common_pages(toks, i, len(toks), self.ps)
            if m < len(child.key):
                child = self.split(child, m)
            mine = pages[pi : pi + m // self.ps]
            if child.tier is Tier.GPU:
                self.pool.decref(mine)  # the tree has these tokens: drop the caller's (duplicate) reference
            else:
                # The tree kept these on host; the caller's fresh GPU pages are better than a copy back.
                assert self.host is not None
                self.host.pool.decref(child.pages)
                self.retier(child, list(mine), Tier.GPU)
            path.append(child)
            node, i = child, i + m
        self._touch(path, session, now)
        if session is not None:
            self._enforce_cap()

    def end_turn(self, session: str) -> None:
        """A session's turn is done: its lease runs a fresh TTL and its eviction keys move with it; with a disk
        tier, its new pages are written behind (radix_disk.py)."""
        super().end_turn(session)
        self.index.refreshed(session)
        self.evictor.repush_session(session)
        self._enforce_cap()
        if self.disk is not None:
            self.disk.write_behind(self, session)

    def deepest(self, session: str) -> Node | None:
        """The deepest node the session's last sequence reached, while it is in the tree."""
        n = self._hints.get(session)
        return n if n is not None and n.alive else None

    # ---- eviction, demotion, promotion (radix_evict.py) ----

    def keep_states(self, points: StatePoints) -> None:
        self.evictor.states = points

    def evict(self, num_pages: int) -> int:
        """Free at least num_pages GPU pages if possible (demoting to host where it has room). Returns the
        number of GPU pages freed."""
        return self.evictor.evict(num_pages)

    def evict_host(self, num_pages: int) -> int:
        """Drop host leaves, least recently used first (the host tier is the last stop before recompute)."""
        return self.evictor.evict_host(num_pages)

    def demote(self, num_pages: int) -> int:
        """Move at least num_pages of unlocked GPU leaves to host now (e.g. ahead of a burst). Returns pages
        moved; 0 without a host tier."""
        return self.evictor.demote(num_pages)

    def drop_session(self, session: str) -> int:
        """Forget a session: untag its nodes and free those no other session uses and no request holds.
        Returns pages freed (both tiers)."""
        nodes = self.index.forget(session)
        self._hints.pop(session, None)
        freed = 0
        for n in sorted(nodes, key=lambda n: n.start, reverse=True):  # children before parents
            if not n.alive or n.sessions or n.children or self.locked(n):
                continue
            parent = n.parent
            assert parent is not None
            freed += len(n.pages)
            self.remove(n)
            self.evictor.push_candidate(parent)
        return freed

    def _enforce_cap(self) -> None:
        for sid in self.index.release_over_cap(self.leases_holding_pages(), self.pool.capacity):
            self.evictor.repush_session(sid)

    # The tests' window on the heaps (snapshots, the compaction bound); the heaps are the evictor's.
    @property
    def _gpu_heap(self) -> list[HeapEntry]:
        return self.evictor.gpu_heap

    @property
    def _host_heap(self) -> list[HeapEntry]:
        return self.evictor.host_heap

    # ---- counters and checks ----

    def stats(self) -> CacheStats:
        return CacheStats(
            policy=self.policy,
            gpu_pages=self.gpu_pages,
            host_pages=self.host_pages,
            host_total_pages=self.host.pool.capacity if self.host is not None else 0,
            leased_pages=self.index.leased_pages(self.leases_holding_pages()),
            evictions=self.evictions,
            demotions=self.demotions,
            promotions=self.promotions,
            host_evictions=self.host_evictions,
            sessions=len(self.sessions),
            live_leases=len(self.sessions.live()),
            **(self.disk.stats() if self.disk is not None else {}),
        )

    def session_pages(self, session: str) -> dict[Tier, int]:
        """Pages of the session's nodes per tier; with a disk tier, also its history on disk since the last
        start (until it returns)."""
        out = self.index.pages_by_tier(session)
        if self.disk is not None:
            out[Tier.DISK] = self.disk.session_pages(session)
        return out

    def check_integrity(self, running_refs: Counter[int] | None = None) -> None:
        check_integrity(self, running_refs)
