"""The radix cache's nodes (a run of page-aligned tokens, the pages holding their KV on one tier, the sessions
whose sequences pass through it) and the two results of using the tree: a `Match` (what a pure lookup found,
nothing held) and a `Lock` (what locking a match gave the caller). The tree mechanics live in radix_tree.py,
eviction in radix_evict.py."""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from agentbox.prefix import common_prefix, ids_equal, ids_prefix

if TYPE_CHECKING:
    from agentbox.engine.cache.disk_tier import PageRef


class Tier(Enum):
    GPU = "gpu"
    HOST = "host"
    DISK = "disk"  # never a node's tier: pages on disk are outside the tree until a lock reads them back


class Node:
    __slots__ = (
        "key",
        "pages",
        "tier",
        "parent",
        "children",
        "sessions",
        "start",
        "last_access",
        "version",
        "alive",
        "_key_ids",
    )

    def __init__(
        self, key: tuple[int, ...], pages: list[int], tier: Tier, parent: Node | None, start: int,
        ids: array | None = None,
    ) -> None:
        self.key = key
        self.pages = pages
        self.tier = tier
        self.parent = parent
        self.children: dict[tuple[int, ...], Node] = {}
        self.sessions: set[str] = set()
        self.start = start  # token offset of key[0] in the sequence
        self.last_access = 0.0
        self.version = 0
        self.alive = True
        self._key_ids = ids  # the key as an int32 array when the caller had one

    def key_ids(self) -> array:
        """The key as an int32 array, made on first use and kept while the key is (a split resets it): a warm
        turn compares its prompt's array with the keys of its session's path in numpy (agentbox/prefix.py), where
        the tuples' element-by-element object compare cost ~0.5 ms per 121k tokens on this Xeon."""
        if self._key_ids is None:
            self._key_ids = array("i", self.key)
        return self._key_ids

    def common_pages(self, toks: tuple[int, ...] | array, i: int, stop: int, page_size: int) -> int:
        """Whole pages (in tokens) on which the key and toks[i:stop] agree."""
        key = self.key
        n = min(len(key), stop - i)
        if isinstance(toks, array):  # numpy over both arrays in place (agentbox/prefix.py)
            return min(n, ids_prefix(self.key_ids(), toks, i)) // page_size * page_size
        if key[:n] == toks[i : i + n]:
            return n // page_size * page_size
        return common_prefix(key, toks[i : i + n]) // page_size * page_size

    def found_at(self, toks: tuple[int, ...] | array) -> bool:
        """toks holds this node's key at its position (toks[start : start + len(key)] == key)."""
        if isinstance(toks, array):
            return ids_equal(toks, self.start, self.key_ids())
        return toks[self.start : self.start + len(self.key)] == self.key

    def split_at(self, m: int) -> tuple[tuple[int, ...], array | None]:
        """Keep the key's tokens from m on; returns the first m (and their array, when this node had one)."""
        head, ids = self.key[:m], self._key_ids
        self.key = self.key[m:]
        self._key_ids = None if ids is None else ids[m:]
        return head, None if ids is None else ids[:m]

    def is_gpu_leaf(self) -> bool:
        """A GPU node without GPU children: the GPU tier's eviction candidates."""
        return self.tier is Tier.GPU and all(c.tier is Tier.HOST for c in self.children.values())

    def is_host_leaf(self) -> bool:
        return self.tier is Tier.HOST and not self.children


def as_key(toks: tuple[int, ...] | array, a: int, b: int) -> tuple[int, ...]:
    """toks[a:b] as a tuple: keys and the children's page keys are tuples, whatever a lookup was given."""
    return toks[a:b] if isinstance(toks, tuple) else tuple(toks[a:b])


@dataclass(frozen=True)
class Below:
    """Where a matched path continues on the tier below memory (the disk tier's pages, radix_disk.py): opaque to
    every caller; `lock` reads it back."""

    refs: tuple[PageRef, ...]  # the pages, in order
    tokens: tuple[int, ...]  # their tokens

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class Match:
    """What `RadixCache.match` found: a description of the tree, holding nothing. Valid until the cache next
    changes (`lock` refuses it after that); nodes are not split yet, so the last one may be matched in part.
    Which tier holds what is the cache's business: a caller reads how many tokens it matched and how many of
    them a lock copies in (`num_copied_tokens`), never where they are."""

    path: tuple[Node, ...]  # root to the deepest matched node; device nodes first, then slower ones
    num_tokens: int  # page-aligned tokens matched, every tier
    num_copied_tokens: int  # of num_tokens, those a lock copies into fresh device pages (from a slower tier)
    session: str | None  # the given session, else the one inferred from the tree's tags
    epoch: int  # the cache's mutation count when the lookup ran
    below: Below | None = None  # the path's continuation below memory (its last tokens), when there is one

    @property
    def num_resident_tokens(self) -> int:
        """Tokens whose pages a lock shares as they are (no copy): the caller needs pages for the rest."""
        return self.num_tokens - self.num_copied_tokens


@dataclass(frozen=True)
class Lock:
    """What `RadixCache.lock` gave the caller: its own reference on every page of the prefix. The caller hands
    them back through `insert` (turn done, preemption) or `release` (abort)."""

    pages: list[int]  # device pages covering the first num_tokens tokens, one reference each for the caller
    num_tokens: int
    num_copied_tokens: int  # of num_tokens, those copied in from a slower tier
    session: str | None
