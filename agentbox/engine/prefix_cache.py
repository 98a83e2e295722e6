"""The interface between the scheduler and a prefix cache (implemented by radix_cache.RadixCache).

Reference discipline: a match hands the caller its own reference on each matched page; `insert` consumes
the caller's references on the pages it is given (new nodes keep them, duplicates are dropped); pages the
caller holds beyond what it inserts are the caller's to decref.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass
class CacheMatch:
    pages: list[int]  # GPU pages covering the first num_tokens tokens, one reference each for the caller
    num_tokens: int
    num_host_tokens: int = 0  # of num_tokens, those copied back from the host tier
    handle: object | None = None


class PrefixCache(Protocol):
    def match(self, tokens: Sequence[int], session: str | None) -> CacheMatch: ...

    def insert(self, tokens: Sequence[int], pages: list[int], session: str | None) -> None: ...

    def evict(self, num_pages: int) -> int: ...

    def check_integrity(self) -> None: ...

    def stats(self) -> dict: ...
