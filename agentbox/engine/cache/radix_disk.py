"""The radix cache's side of the disk tier (disk_tier.py has the files): which tree pages go to disk and when,
and how a matched run of disk pages comes back.

- Spill: a node leaving the last in-memory tier (a GPU leaf evicted with no host room, a host leaf evicted)
  is written before its pages are freed; pages already on disk (same prefix hash) are not written again.
- Flush: at a graceful stop every tree node is written, top-down (a flush cut short by its deadline still
  leaves usable prefixes), with a progress line.
- Restore: `match` continues its walk on disk (`find`), `lock` reads those pages into fresh GPU pages and
  attaches them to the tree as one new node (`RadixCache.lock`).
"""

from __future__ import annotations

import itertools
import logging
import time
from array import array
from collections.abc import Callable, Sequence

from agentbox.engine.cache.disk_pages import chunk_to_pages, pages_to_bytes
from agentbox.engine.cache.disk_sessions import load_sessions, save_sessions
from agentbox.engine.cache.disk_tier import SESSIONS, DiskTier, PageRef
from agentbox.engine.cache.host_tier import HostTier
from agentbox.engine.cache.kv_pool import PagePool
from agentbox.engine.cache.radix_node import Match, Node, Tier
from agentbox.engine.cache.session_index import SessionIndex
from agentbox.engine.cache.sessions import SessionTable
from agentbox.engine.cache.turns import Turns
from agentbox.layers.backends.base import KVCache

log = logging.getLogger(__name__)

CHUNK_PAGES = 64  # pages per chunk at most: a bounded read for a short match, a bounded loss for a torn file
PROGRESS_EVERY_S = 1.0


def prefix_tokens(n: Node) -> tuple[int, ...]:
    """Every token from the root to n's end."""
    keys = []
    node: Node | None = n
    while node is not None:
        keys.append(node.key)
        node = node.parent
    return tuple(itertools.chain.from_iterable(reversed(keys)))


class DiskLink:
    def __init__(self, tier: DiskTier, page_size: int) -> None:
        self.tier = tier
        self.ps = page_size
        self.spilled = 0  # pages written (spills and flushes)
        self.restored = 0  # pages read back into the tree

    def find(self, toks: tuple[int, ...] | array, start: int) -> tuple[tuple[PageRef, ...], tuple[int, ...], list[str]]:
        """The disk pages continuing toks from token `start` (page-aligned), their tokens and hashes. Pure."""
        found = self.tier.find(toks, self.ps, start // self.ps)
        return tuple(r for _, r in found), tuple(toks[start : start + len(found) * self.ps]), [h for h, _ in found]

    def end_hash(self, n: Node) -> bytes:
        toks = prefix_tokens(n)
        return self.tier.hashes(toks, self.ps, len(toks) // self.ps)[-1]

    def spill(self, n: Node, kv: KVCache) -> int:
        """Write n's pages that are not on disk yet; returns pages written."""
        toks = prefix_tokens(n)
        hs = self.tier.hashes(toks, self.ps, len(toks) // self.ps)[n.start // self.ps :]
        todo = [j for j, h in enumerate(hs) if not self.tier.has(h)]
        written = 0
        for lo in range(0, len(todo), CHUNK_PAGES):
            part = todo[lo : lo + CHUNK_PAGES]
            data = pages_to_bytes(kv, [n.pages[j] for j in part])
            if not self.tier.write([hs[j] for j in part], data):
                break
            written += len(part)
        self.spilled += written
        return written

    def flush(self, nodes: Sequence[Node], kv_of: Callable[[Node], KVCache], deadline: float) -> tuple[int, int]:
        """Write every node (top-down) until the deadline; returns (pages written, pages left unwritten)."""
        total = sum(len(n.pages) for n in nodes)
        done = written = 0
        last = time.monotonic()
        for n in nodes:
            if time.monotonic() > deadline:
                break
            written += self.spill(n, kv_of(n))
            done += len(n.pages)
            if time.monotonic() - last >= PROGRESS_EVERY_S:
                last = time.monotonic()
                log.info("saving the KV cache to disk: %d / %d pages", done, total)
        self.tier.save_index()
        return written, total - done

    def session_ends(self, nodes_of: dict[str, set[Node]]) -> dict[str, tuple[str, int]]:
        """Per session with nodes, the disk hash its deepest node ends on and its tokens (when on disk)."""
        ends = {}
        for sid, nodes in nodes_of.items():
            if nodes:
                deepest = max(nodes, key=lambda n: n.start + len(n.key))
                h = self.end_hash(deepest)
                if self.tier.has(h):
                    ends[sid] = (h.hex(), deepest.start + len(deepest.key))
        return ends

    def save_sessions(self, table: SessionTable, ends: dict[str, tuple[str, int]]) -> None:
        save_sessions(self.tier.dir / SESSIONS, table, ends)

    def load_sessions(self, turns: Turns) -> dict[str, tuple[str, int]]:
        """The sessions saved at the last stop, back in the table; those whose history is still on disk."""
        ends = load_sessions(self.tier.dir / SESSIONS, turns)
        return {sid: e for sid, e in ends.items() if self.tier.has(bytes.fromhex(e[0]))}

    def stats(self, sessions_on_disk: int) -> dict[str, int]:
        t = self.tier
        return {"disk_pages": t.num_pages, "disk_bytes": t.bytes_used, "disk_budget_bytes": t.budget,
                "disk_written": self.spilled, "disk_restored": self.restored, "disk_torn": t.torn,
                "disk_sessions": sessions_on_disk, "disk_states": len(t.states)}


class DiskTree:
    """The RadixCache's disk-tier methods (a mixin: they read the tree's fields declared below), kept apart
    so radix_cache.py holds the tree's own mechanics."""

    disk: DiskLink | None
    kv: KVCache | None
    host: HostTier | None
    pool: PagePool
    root: Node
    ps: int
    on_disk: dict[str, tuple[str, int]]
    index: SessionIndex
    gpu_pages: int
    _epoch: int
    match: Callable[..., Match]
    sessions: SessionTable  # KVManager's property: annotations only here, so nothing shadows the tree's own
    evict: Callable[[int], int]

    def _restored_session(self, hashes: list[str], namespace: str) -> str | None:
        """A keyless request whose disk match runs through the end of a session restored at start (its whole
        last sequence): that session (the deepest such end). Pure."""
        ends = {h: sid for sid, (h, _) in self.on_disk.items() if sid.startswith(namespace)}
        return next((ends[h] for h in reversed(hashes) if h in ends), None)

    def prefetch(self, tokens: Sequence[int], session: str | None = None, namespace: str = "",
                 end: int | None = None) -> None:
        """A request arrived: the disk part of its match is read on the worker thread while it waits for
        admission (its restore then takes the bytes). Changes nothing in the tree."""
        if self.disk is not None and self.disk.tier.pages:
            m = self.match(tokens, session, namespace, end)
            if m.disk:
                self.disk.tier.prefetch(m.disk)

    def _restore(self, parent: Node, m: Match) -> Node | None:
        """Read m's disk pages (as many as GPU room and intact chunks allow) into fresh GPU pages, attached
        under parent as one new node. A chunk is copied in while the next ones are read (disk_reader.py)."""
        assert self.disk is not None and self.kv is not None
        k = len(m.disk)
        if self.pool.num_free < k:
            self.evict(k - self.pool.num_free)
        k = min(k, self.pool.num_free)
        pages = self.pool.alloc(k)
        done = 0
        for chunk, places in self.disk.tier.read_runs(m.disk[:k]):
            chunk_to_pages(self.kv, pages[done : done + len(places)], chunk, places)
            done += len(places)
        self.pool.decref(pages[done:])  # past a torn chunk: back to the free list
        if not done:
            return None
        pages = pages[:done]
        toks = m.disk_tokens[: done * self.ps]
        node = Node(toks, pages, Tier.GPU, parent, parent.start + len(parent.key))
        parent.children[toks[: self.ps]] = node
        self.gpu_pages += len(pages)
        self._epoch += 1
        self.disk.restored += len(pages)
        return node

    def spill(self, n: Node) -> None:
        """n's pages are about to leave memory for good: written to the disk tier first (if there is one)."""
        if self.disk is not None:
            self.disk.spill(n, self._kv_of(n))

    def flush(self, budget_s: float) -> tuple[int, int]:
        """Write every node of the tree to the disk tier (top-down) within budget_s seconds. Returns (pages
        written, pages left unwritten)."""
        if self.disk is None:
            return 0, 0
        nodes = list(self.root.children.values())
        for n in nodes:  # breadth-first: parents before children
            nodes.extend(n.children.values())
        return self.disk.flush(nodes, self._kv_of, time.monotonic() + budget_s)

    def persist(self, budget_s: float) -> tuple[int, int]:
        """A graceful stop: every node to disk (`flush`), then the session table beside it, each session with
        the prefix its cached history ends on. Returns (pages written, pages left unwritten)."""
        if self.disk is None:
            return 0, 0
        written, left = self.flush(budget_s)
        ends = dict(self.on_disk)
        ends.update(self.disk.session_ends({s.id: self.index.of(s.id) for s in self.sessions}))
        self.disk.save_sessions(self.sessions, ends)
        return written, left

    def restore_sessions(self) -> int:
        """The sessions saved at the last stop, back under their ids ("on disk" until they return)."""
        if self.disk is None:
            return 0
        self.on_disk = self.disk.load_sessions(self.turns)
        return len(self.on_disk)

    def _kv_of(self, n: Node) -> KVCache:
        if n.tier is Tier.GPU:
            assert self.kv is not None
            return self.kv
        assert self.host is not None
        return self.host.kv
