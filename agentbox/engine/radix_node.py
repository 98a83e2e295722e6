"""The radix cache's nodes: a run of page-aligned tokens, the pages holding their KV on one tier, and the
sessions whose sequences pass through it. The tree mechanics live in radix_cache.py."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from agentbox.engine.prefix_cache import CacheMatch


class Tier(Enum):
    GPU = "gpu"
    HOST = "host"


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
    )

    def __init__(
        self, key: tuple[int, ...], pages: list[int], tier: Tier, parent: Node | None, start: int
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


@dataclass
class Match(CacheMatch):
    """CacheMatch plus the session the request belongs to (given, or inferred from the tree)."""

    session: str | None = None
