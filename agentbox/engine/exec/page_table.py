"""The persistent page table: one row per running request, kept on every tensor-parallel rank.

Rebuilding a [batch, pages] table from Python lists every step costs time proportional to the context
(2,048 pages per request at 32k tokens). Instead each request keeps a row; a step writes only the pages
its request gained since the last step (one every page_size decode steps), and the attention metadata is
a gather of the step's rows. Rank 0 keeps the table in step with the requests' cache handles (`RowWriter`); every rank
applies the same updates to its own `PageTable` (it sees only tensors), so page ids agree everywhere.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from agentbox.prefix import common_prefix

if TYPE_CHECKING:  # the cache's handle, for hints only: exec must not import the engine core at run time
    from agentbox.engine.cache.seq_cache import SeqCache


class PageTable:
    def __init__(self, num_rows: int, max_pages: int, device: torch.device) -> None:
        self.table = torch.zeros((num_rows, max_pages), dtype=torch.int32, device=device)

    def apply(self, updates: torch.Tensor) -> None:
        """updates: int64 [U, 3] of (row, column, page)."""
        if updates.numel():
            u = updates.to(self.table.device)
            self.table[u[:, 0], u[:, 1]] = u[:, 2].to(torch.int32)

    def rows(self, rows: torch.Tensor, num_cols: int) -> torch.Tensor:
        """The step's [B, num_cols] page table (entries past a sequence's pages are stale: kv_lens mask them)."""
        return self.table[:, :num_cols].index_select(0, rows.to(self.table.device))


class RowWriter:
    """Rank 0's side: what each row of the table holds, and what to write into it this step. Rows are the cache's
    to hand out (a request's handle names its row: engine/cache/rows.py); this only keeps the table in step
    with the handles' pages, reading them and writing nothing of theirs.

    A row keeps its pages after its request ends (nothing reads a free row), and a session's next request gets
    the row its last one held: a warm turn's pages start with the last turn's (the locked prefix), so only the
    columns after the first difference are written, not ~7.5k at 128k tokens."""

    def __init__(self, num_rows: int) -> None:
        self.contents: list[list[int]] = [[] for _ in range(num_rows)]  # the pages each row holds, by column
        self._owner: list[SeqCache | None] = [None] * num_rows  # the handle the row was last written for
        self._generation = [0] * num_rows  # its generation then (a cut tail bumps it)

    def fresh(self, h: SeqCache) -> bool:
        """The row was last written for another handle (a new admission on it)."""
        return self._owner[h.row] is not h

    def updates(self, handles: list[SeqCache]) -> list[int]:
        """The flat (row, column, page) triples to write before the step: the columns of each handle's pages that
        its row does not hold yet (usually none; one when a decode crosses a page boundary)."""
        out: list[int] = []
        for h in handles:
            row, pages = h.row, h.pages
            held = self.contents[row]
            if self._owner[row] is not h or self._generation[row] != h.generation:
                have = common_prefix(held, pages)  # a new owner, or a cut tail: the row holds this much of it
                self._owner[row], self._generation[row] = h, h.generation
            else:
                have = len(held)
            if have == len(pages) == len(held):
                continue
            del held[have:]
            for col in range(have, len(pages)):
                out += (row, col, pages[col])
                held.append(pages[col])
        return out
