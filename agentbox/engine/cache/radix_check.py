"""The radix cache's invariants, checked in full: tests call it after every step of a random walk, and the
engine after each step when its integrity checks are on. O(tree + pools), never on the hot path."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Protocol

from agentbox.engine.cache.host_tier import HostTier
from agentbox.engine.cache.kv_pool import PagePool
from agentbox.engine.cache.radix_node import Node, Tier
from agentbox.engine.cache.session_index import SessionIndex


class Queued(Protocol):
    def queued(self) -> Iterator[Node]: ...


class Checked(Protocol):
    """What the check reads of the cache (RadixCache)."""

    pool: PagePool
    host: HostTier | None
    evictor: Queued
    root: Node
    ps: int
    index: SessionIndex
    gpu_pages: int
    host_pages: int


def check_integrity(cache: Checked, running_refs: Counter[int] | None = None) -> None:
    """Pools consistent; every GPU page's refcount == (1 if the tree owns it) + running_refs[page]
    (only >= 1 for owned pages when running_refs is None); host pages exactly 1 if owned else 0; tree
    shape, tags, counters and heap coverage consistent."""
    cache.pool.check_integrity()
    if cache.host is not None:
        cache.host.pool.check_integrity()
    owned_gpu: set[int] = set()
    owned_host: set[int] = set()
    in_heap = {id(n) for n in cache.evictor.queued()}
    stack = list(cache.root.children.values())
    while stack:
        n = stack.pop()
        parent = n.parent
        assert parent is not None and n.alive, "a detached node in the tree"
        assert parent.children.get(n.key[: cache.ps]) is n, (
            "child keyed by something else than its first page"
        )
        assert n.pages and len(n.key) == len(n.pages) * cache.ps, "key and pages disagree"
        assert n.start == parent.start + len(parent.key), "start offset wrong"
        assert n.tier is Tier.HOST or parent.tier is Tier.GPU, "a GPU node under a host node"
        assert parent is cache.root or n.sessions <= parent.sessions, "child tagged beyond its parent"
        for sid in n.sessions:
            assert n in cache.index.of(sid), f"node tagged {sid} missing from its set"
        owned = owned_gpu if n.tier is Tier.GPU else owned_host
        for p in n.pages:
            assert p not in owned, f"page {p} owned twice"
            owned.add(p)
        if n.is_gpu_leaf() or n.is_host_leaf():
            assert id(n) in in_heap, "a leaf missing from its heap"
        stack.extend(n.children.values())
    for sid, nodes in cache.index.nodes.items():
        for n in nodes:
            assert n.alive and sid in n.sessions, f"session {sid} lists a dead or untagged node"
    assert cache.gpu_pages == len(owned_gpu) and cache.host_pages == len(owned_host), "page counters off"
    refs = running_refs if running_refs is not None else Counter()
    for p in range(1, cache.pool.num_pages):
        rc = cache.pool.refcount[p]
        # Only the tree's pages are shared (by locks): what `reclaimable` counts on.
        assert rc <= 1 or p in owned_gpu, f"GPU page {p}: {rc} holders but not a tree page"
        if running_refs is None:
            assert p not in owned_gpu or rc >= 1, f"tree page {p} is free"
        else:
            want = (p in owned_gpu) + refs[p]
            assert rc == want, f"GPU page {p}: refcount {rc}, expected {want}"
    if cache.host is not None:
        for p in range(1, cache.host.pool.num_pages):
            rc, want = cache.host.pool.refcount[p], int(p in owned_host)
            assert rc == want, f"host page {p}: refcount {rc}, expected {want}"
