"""`SeqCache`: a running request's cache handle (`Request.cache_handle`), what mini-sglang calls a cache
handle. The cache creates it when it locks a request's prefix and is the only writer of its fields (manager.py,
state_group.py); the scheduler holds it without looking inside; the runner reads `pages` and `row` to build the
step's slots and page-table rows, and nothing else.
"""

from __future__ import annotations


class SeqCache:
    __slots__ = ("pages", "row", "generation", "seed", "aligned_at", "prompt_saved", "prompt_at", "share_at",
                 "published")

    def __init__(self, pages: list[int], row: int) -> None:
        # One device page per page_size tokens: the request's locked prefix, then what it reserved since. Every
        # paged group of the layout shares these page ids (layers/cache_layout.py).
        self.pages = pages
        # Its page-table row, and its live state slot for a model with a state group.
        self.row = row
        # Bumped whenever `pages` loses entries (a rejected draft's tail): the runner's copy of the row is valid
        # only up to the cut then (engine/exec/page_table.py).
        self.generation = 0
        # A state snapshot slot the request's row is seeded from before its first step (state_group.py).
        self.seed: int | None = None
        # The position the row's page-aligned state copy holds, as the runner reported it (0: none yet).
        self.aligned_at = 0
        self.prompt_saved = False  # its prompt snapshot is taken
        # > 0: where the prompt snapshot is taken, the last page boundary at or before the history's end (the prompt
        # less the tail of the generation prompt the next turn renders otherwise); 0: the prompt's last boundary.
        self.prompt_at = 0
        self.share_at = 0  # > 0: keep the state at this position as a shared-prefix snapshot
        self.published = 0  # leading pages already in the tree while the request runs (CacheManager.publish)

    def cut(self, keep: int) -> list[int]:
        """Drops the pages past the first `keep` and returns them."""
        gone = self.pages[keep:]
        if gone:
            del self.pages[keep:]
            self.generation += 1
        return gone
