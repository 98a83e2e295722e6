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
from collections.abc import Callable, Sequence

from agentbox.engine.cache.disk_pages import pages_to_bytes
from agentbox.engine.cache.disk_tier import DiskTier, PageRef
from agentbox.engine.cache.radix_node import Node
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

    def find(self, toks: tuple[int, ...], start: int) -> tuple[tuple[PageRef, ...], tuple[int, ...]]:
        """The disk pages continuing toks from token `start` (page-aligned), and their tokens. Pure."""
        refs = self.tier.find(toks, self.ps, start // self.ps)
        return tuple(refs), toks[start : start + len(refs) * self.ps]

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
