"""Eviction of a hybrid model's pages together with the recurrent-state snapshots that resume them (the evictor,
radix_evict.py, calls `evict_unit` for each leaf it takes when the cache keeps states).

A Gated DeltaNet layer's state resumes only at the exact position a snapshot was saved (state_snapshots.py), so
a cached page is worth keeping only while some snapshot sits at or past it on a path through it: a request
resumes at the deepest snapshot its match reaches and computes everything after it again. Hence the unit:
- a snapshot whose prefix loses a page can never be resumed: it leaves with the node that held the page (its
  slot goes to another), and never stays behind while its pages are gone;
- pages past the deepest snapshot of a leaf are dead weight: they go first, alone (the snapshot stays);
- a subtree left without any snapshot is dead weight too: it leaves together with the node whose eviction
  emptied it, up to the deepest node another snapshot still needs (the shared system prompt's, usually). A
  session keeps one snapshot per point, so its whole chain of turns hangs on the last one: an idle session
  leaves as one unit, snapshot and pages, instead of a tail that kills the rest while the rest stays resident.
Measured without it (bench/results/hybrid-replay, 400 pages): the tiny hybrid recomputed 20.8 % of its history
against the dense model's 13.0 %, evicting 914 pages against 725.

Which snapshot lies on which path: a snapshot names its position and the digest of the tokens before it, so a
node's subtree is walked with a running digest (`needed`); only positions some snapshot has are hashed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from agentbox.engine.cache.radix_disk import prefix_tokens
from agentbox.engine.cache.radix_node import Node, Tier
from agentbox.engine.cache.state_snapshots import Snapshot


class StatePoints(Protocol):
    """What the evictor asks of the snapshot store (SnapshotStore)."""

    def after(self, position: int) -> list[Snapshot]:
        """Every snapshot held at a position past `position` (any tier)."""
        ...

    def discard(self, snap: Snapshot) -> None:
        """Drop `snap`: the pages it resumes on are gone."""
        ...


class UnitTree(Protocol):
    """What a unit's eviction asks of the tree (RadixCache)."""

    root: Node

    def locked(self, n: Node) -> bool: ...

    def split(self, n: Node, m: int) -> Node: ...


class Evictor(Protocol):
    """What a unit's eviction asks of the evictor (radix_evict.Evictor): its moves and counters."""

    tree: UnitTree
    evictions: int
    host_evictions: int

    def evict_node(self, n: Node) -> int: ...

    def drop_subtree(self, n: Node) -> None: ...

    def push_candidate(self, n: Node) -> None: ...


def _update(h: hashlib._Hash, tokens: Sequence[int]) -> None:
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())  # the bytes state_snapshots.digest hashes


def needed(n: Node, points: StatePoints) -> list[Snapshot]:
    """The snapshots that resume on n's pages: at a position in n's tokens or in its subtree's. Pure."""
    cands = points.after(n.start)
    if not cands:
        return []
    h = hashlib.blake2b(digest_size=16)
    if n.parent is not None:
        _update(h, prefix_tokens(n.parent))
    out: list[Snapshot] = []
    stack = [(n, h)]
    while stack:
        d, h = stack.pop()
        end = d.start + len(d.key)
        for s in cands:
            if d.start < s.num_tokens <= end:
                g = h.copy()
                _update(g, d.key[: s.num_tokens - d.start])
                if g.digest() == s.digest:
                    out.append(s)
        if d.children and any(s.num_tokens > end for s in cands):
            _update(h, d.key)
            stack += [(c, h.copy()) for c in d.children.values()]
    return out


def _locked_below(ev: Evictor, n: Node) -> bool:
    return ev.tree.locked(n) or any(_locked_below(ev, c) for c in n.children.values())


def _pages_below(n: Node, tier: Tier) -> int:
    return (len(n.pages) if n.tier is tier else 0) + sum(_pages_below(c, tier) for c in n.children.values())


def evict_unit(ev: Evictor, n: Node, points: StatePoints) -> int:
    """Evict the unlocked GPU leaf n as a hybrid model needs: its dead tail alone when a snapshot sits inside it,
    else n with the snapshots it held and every ancestor left holding none. Returns GPU pages freed."""
    snaps = needed(n, points)
    deepest = max((s.num_tokens for s in snaps), default=n.start)
    end = n.start + len(n.key)
    if n.start < deepest < end and not n.children:
        ev.tree.split(n, deepest - n.start)  # n keeps the tail past the snapshot
        return ev.evict_node(n)
    freed = ev.evict_node(n)
    if n.alive:  # demoted to host: its pages still resume there, with their snapshots
        return freed
    for s in snaps:
        points.discard(s)
    return freed + _drop_dead_ancestors(ev, n.parent, points)[0]


def drop_host_unit(ev: Evictor, n: Node, points: StatePoints) -> int:
    """Drop the unlocked host leaf n, the snapshots it held and every ancestor left holding none. Returns host
    pages freed."""
    snaps = needed(n, points)
    parent = n.parent
    assert parent is not None
    ev.host_evictions += len(n.pages)
    ev.drop_subtree(n)
    ev.push_candidate(parent)
    for s in snaps:
        points.discard(s)
    return len(n.pages) + _drop_dead_ancestors(ev, parent, points)[1]


def _drop_dead_ancestors(ev: Evictor, p: Node | None, points: StatePoints) -> tuple[int, int]:
    """Drop the highest ancestor of an evicted node whose subtree no snapshot needs (with that subtree).
    Returns the (GPU, host) pages freed."""
    top = None
    while p is not None and p is not ev.tree.root and not _locked_below(ev, p) and not needed(p, points):
        top, p = p, p.parent
    if top is None:
        return 0, 0
    parent = top.parent
    assert parent is not None
    gpu, host = _pages_below(top, Tier.GPU), _pages_below(top, Tier.HOST)
    ev.drop_subtree(top)  # counts the host pages below top
    ev.evictions += gpu
    ev.host_evictions += len(top.pages) if top.tier is Tier.HOST else 0
    ev.push_candidate(parent)
    return gpu, host
