"""The persistent page table: one row per running request, kept on every tensor-parallel rank.

Rebuilding a [batch, pages] table from Python lists every step costs time proportional to the context
(2,048 pages per request at 32k tokens). Instead each request keeps a row; a step writes only the pages
its request gained since the last step (one every page_size decode steps), and the attention metadata is
a gather of the step's rows. Rank 0 decides rows and updates (`RowAssigner`, it sees Requests); every rank
applies the same updates to its own `PageTable` (it sees only tensors), so page ids agree everywhere.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # the core's type, for hints only: exec must not import the core at run time
    from agentbox.engine.request import Request



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


class RowAssigner:
    """Rank 0's side: which row each request holds, and what to write into it this step."""

    def __init__(self, num_rows: int) -> None:
        self.owners: list[Request | None] = [None] * num_rows
        self._free = list(range(num_rows - 1, -1, -1))

    def _sweep(self, keep: set[int]) -> None:
        """Frees rows of requests that are no longer running (finished, preempted, a one-off logits call)."""
        for row, owner in enumerate(self.owners):
            if owner is not None and id(owner) not in keep and not owner.is_running:
                owner.table_row, owner.pages_in_table = None, 0
                self.owners[row] = None
                self._free.append(row)

    def assign(self, reqs: list[Request]) -> tuple[list[int], list[int]]:
        """Rows for the step's requests, and the flat (row, column, page) triples to write first."""
        fresh = [r for r in reqs if r.table_row is None or self.owners[r.table_row] is not r]
        if len(fresh) > len(self._free):
            self._sweep({id(r) for r in reqs})
        rows: list[int] = []
        updates: list[int] = []
        for r in reqs:
            if r.table_row is None or self.owners[r.table_row] is not r:
                if not self._free:
                    raise RuntimeError(f"page table full: {len(self.owners)} rows, all running")
                r.table_row, r.pages_in_table = self._free.pop(), 0
                self.owners[r.table_row] = r
            row, have, pages = r.table_row, r.pages_in_table, r.pages
            for col in range(have, len(pages)):  # usually none; one when a decode crosses a page boundary
                updates += (row, col, pages[col])
            r.pages_in_table = len(pages)
            rows.append(row)
        return rows, updates
