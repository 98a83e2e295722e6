"""The radix cache's side of the disk tier (disk_tier.py has the files): which tree pages go to disk and when,
and how a matched run of disk pages comes back. `DiskLink` is an object the cache holds (`RadixCache.disk`),
not a part of it: it sees the tree through `DiskTree`, the few members it reads and the one it calls.

- Spill: a node leaving the last in-memory tier (a GPU leaf evicted with no host room, a host leaf evicted)
  is written before its pages are freed; pages already on disk (same prefix hash) are not written again.
- Write-behind: when a turn ends, the pages of its session's path that are not on disk yet are copied out of
  the pool and queued to the tier's writer thread (disk_writer.py), so a crash of the engine loses at most the
  turns in flight, and the next start reads every finished turn back. The copy runs when the turn's pages go
  into the tree, a step after its answer went out; the write and its fsync never hold a step.
- Flush: at a graceful stop the queued writes finish, then every tree node is written, top-down (a flush cut
  short by its deadline still leaves usable prefixes), with a progress line.
- Restore: `match` continues its walk on disk (`find`), `lock` reads those pages into fresh GPU pages and
  attaches them to the tree as one new node (`RadixCache.lock`).
"""

from __future__ import annotations

import itertools
import logging
import time
from array import array
from typing import Protocol

from agentbox.engine.cache.disk_pages import chunk_to_pages, pages_to_bytes
from agentbox.engine.cache.disk_sessions import load_sessions, save_sessions, session_row, sessions_file
from agentbox.engine.cache.disk_tier import SESSIONS, DiskTier
from agentbox.engine.cache.disk_writer import Write
from agentbox.engine.cache.kv_pool import PagePool
from agentbox.engine.cache.radix_node import Below, Node
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


class DiskTree(Protocol):
    """What the disk side reads of the tree it serves (RadixCache), and the one thing it asks of it."""

    pool: PagePool
    kv: KVCache | None  # the device pool's tensors
    root: Node
    index: SessionIndex
    turns: Turns

    @property
    def sessions(self) -> SessionTable: ...

    def kv_of(self, n: Node) -> KVCache: ...

    def attach(self, parent: Node, tokens: tuple[int, ...], pages: list[int]) -> Node: ...

    def deepest(self, session: str) -> Node | None: ...

    def evict(self, num_pages: int) -> int: ...


class DiskLink:
    """The disk tier below a radix cache's memory tiers. Pages on disk are outside the tree: `find` continues a
    lookup's walk there, `restore` reads them back as a new node, `spill` writes a node leaving memory."""

    def __init__(self, tier: DiskTier, page_size: int) -> None:
        self.tier = tier
        self.ps = page_size
        self.spilled = 0  # pages written (spills and flushes)
        self.written_behind = 0  # pages queued by write-behind at turn ends
        self.restored = 0  # pages read back into the tree
        self.on_disk: dict[str, tuple[str, int]] = {}  # sessions restored at start, not back yet: end hash, tokens
        self._rows: dict[str, str] = {}  # session -> its row of the session table as last written behind

    def find(self, toks: tuple[int, ...] | array, start: int, session: str | None,
             namespace: str) -> tuple[Below | None, str | None]:
        """The disk pages continuing toks from token `start` (page-aligned), and the session restored at start
        whose whole last sequence they run through when none is given. Pure."""
        found = self.tier.find(toks, self.ps, start // self.ps)
        if not found:
            return None, session
        refs = tuple(r for _, r in found)
        below = Below(refs, tuple(toks[start : start + len(found) * self.ps]))
        if session is None and self.on_disk:
            session = self._restored_session([h for h, _ in found], namespace)
        return below, session

    def _restored_session(self, hashes: list[str], namespace: str) -> str | None:
        """A keyless request whose disk match runs through the end of a session restored at start (its whole
        last sequence): that session (the deepest such end). Pure."""
        ends = {h: sid for sid, (h, _) in self.on_disk.items() if sid.startswith(namespace)}
        return next((ends[h] for h in reversed(hashes) if h in ends), None)

    def prefetch(self, below: Below) -> None:
        """A request waits for admission: its disk pages are read on the worker thread meanwhile (its restore
        then takes the bytes). Changes nothing in the tree."""
        self.tier.prefetch(below.refs)

    def restore(self, tree: DiskTree, parent: Node, below: Below) -> Node | None:
        """Read `below`'s pages (as many as device room and intact chunks allow) into fresh device pages, attached
        under parent as one new node. A chunk is copied in while the next ones are read (disk_reader.py)."""
        pool = tree.pool
        k = len(below.refs)
        if pool.num_free < k:
            tree.evict(k - pool.num_free)
        k = min(k, pool.num_free)
        pages = pool.alloc(k)
        done = 0
        kv = tree.kv
        assert kv is not None
        for chunk, places in self.tier.read_runs(below.refs[:k]):
            chunk_to_pages(kv, pages[done : done + len(places)], chunk, places)
            done += len(places)
        pool.decref(pages[done:])  # past a torn chunk: back to the free list
        if not done:
            return None
        self.restored += done
        return tree.attach(parent, below.tokens[: done * self.ps], pages[:done])

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

    def write_behind(self, tree: DiskTree, session: str) -> int:
        """The session's turn ended: its path's pages not on disk (nor queued) yet go to the writer thread, a
        chunk per node or CHUNK_PAGES. Returns pages queued."""
        node = tree.deepest(session)
        path: list[Node] = []
        while node is not None and node is not tree.root:
            path.append(node)
            node = node.parent
        if not path:
            return 0
        path.reverse()
        toks = prefix_tokens(path[-1])
        hs = self.tier.hashes(toks, self.ps, len(toks) // self.ps)
        queued = 0
        for n in path:
            first = n.start // self.ps
            todo = [j for j in range(len(n.pages)) if not self.tier.has(hs[first + j])]
            for lo in range(0, len(todo), CHUNK_PAGES):
                part = todo[lo : lo + CHUNK_PAGES]
                data = pages_to_bytes(tree.kv_of(n), [n.pages[j] for j in part])
                if not self.tier.write_behind([hs[first + j] for j in part], data):
                    self.written_behind += queued
                    return queued
                queued += len(part)
        self.written_behind += queued
        s = tree.sessions.get(session)
        if s is not None:
            self._rows[session] = session_row(s, (hs[-1].hex(), len(toks)))
            self._write_sessions(tree)
        return queued

    def _write_sessions(self, tree: DiskTree) -> None:
        """The session table behind the pages (the writer keeps only the newest queued copy): each row as it was
        at that session's last turn end, a session restored at start and not back yet as it was restored."""
        table = tree.sessions
        for sid in [sid for sid in self._rows if sid not in table]:
            del self._rows[sid]
        for s in table:
            if s.id not in self._rows:
                self._rows[s.id] = session_row(s, self.on_disk.get(s.id))
        self.tier.writer.submit(Write(SESSIONS, self.tier.dir / SESSIONS, sessions_file(list(self._rows.values())),
                                      [], sidecar=True))

    def flush(self, tree: DiskTree, budget_s: float) -> tuple[int, int]:
        """Write every node of the tree (top-down: a flush cut short by its deadline still leaves usable
        prefixes) within budget_s seconds, after the queued write-behind. Returns (pages written, pages left
        unwritten)."""
        deadline = time.monotonic() + budget_s
        self.tier.finish_writes(budget_s)
        nodes = list(tree.root.children.values())
        for n in nodes:  # breadth-first: parents before children
            nodes.extend(n.children.values())
        total = sum(len(n.pages) for n in nodes)
        done = written = 0
        last = time.monotonic()
        for n in nodes:
            if time.monotonic() > deadline:
                break
            written += self.spill(n, tree.kv_of(n))
            done += len(n.pages)
            if time.monotonic() - last >= PROGRESS_EVERY_S:
                last = time.monotonic()
                log.info("saving the KV cache to disk: %d / %d pages", done, total)
        self.tier.save_index()
        return written, total - done

    def persist(self, tree: DiskTree, budget_s: float) -> tuple[int, int]:
        """A graceful stop: every node to disk (`flush`), then the session table beside it, each session with
        the prefix its cached history ends on. Returns (pages written, pages left unwritten)."""
        written, left = self.flush(tree, budget_s)
        ends = dict(self.on_disk)
        ends.update(self._session_ends({s.id: tree.index.of(s.id) for s in tree.sessions}))
        save_sessions(self.tier.dir / SESSIONS, tree.sessions, ends)
        return written, left

    def _session_ends(self, nodes_of: dict[str, set[Node]]) -> dict[str, tuple[str, int]]:
        """Per session with nodes, the disk hash its deepest node ends on and its tokens (when on disk)."""
        ends = {}
        for sid, nodes in nodes_of.items():
            if nodes:
                deepest = max(nodes, key=lambda n: n.start + len(n.key))
                h = self.end_hash(deepest)
                if self.tier.has(h):
                    ends[sid] = (h.hex(), deepest.start + len(deepest.key))
        return ends

    def restore_sessions(self, turns: Turns) -> int:
        """The sessions saved at the last stop, back in the table under their ids ("on disk" until they return:
        those whose history is still on disk)."""
        ends = load_sessions(self.tier.dir / SESSIONS, turns)
        self.on_disk = {sid: e for sid, e in ends.items() if self.tier.has(bytes.fromhex(e[0]))}
        return len(self.on_disk)

    def returned(self, session: str) -> None:
        """The session locked or inserted a path: it is back, not "on disk"."""
        self.on_disk.pop(session, None)

    def session_pages(self, session: str) -> int:
        """Pages of the session's history on disk since the last start (until it returns)."""
        end = self.on_disk.get(session)
        return end[1] // self.ps if end is not None and end[0] in self.tier.pages else 0

    def stats(self) -> dict[str, int]:
        t = self.tier
        t.collect()
        return {"disk_pages": t.num_pages, "disk_bytes": t.bytes_used, "disk_budget_bytes": t.budget,
                "disk_written": t.written, "disk_restored": self.restored, "disk_torn": t.torn,
                "disk_sessions": len(self.on_disk), "disk_states": len(t.states),
                "disk_written_behind": self.written_behind, "disk_queued": t.writer.pending,
                "disk_dropped": t.writer.dropped}
