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

from agentbox import collector
from agentbox.prefix import common_prefix

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
    """Rank 0's side: which row each request holds, and what to write into it this step.

    A row keeps its pages after its request ends (nothing reads a free row), and a session's next request
    takes the row its last one held when it is free: a warm turn's pages start with the last turn's (the
    locked prefix), so only the columns after the first difference are written, not ~7.5k at 128k tokens."""

    def __init__(self, num_rows: int) -> None:
        self.owners: list[Request | None] = [None] * num_rows
        self._free = list(range(num_rows - 1, -1, -1))
        self.contents: list[list[int]] = [[] for _ in range(num_rows)]  # the pages each row holds, by column
        self._session_rows: dict[str, int] = {}  # the row a session's last request held

    def _sweep(self, keep: set[int]) -> None:
        """Frees rows of requests that are no longer running (finished, preempted, a one-off logits call)."""
        for row in range(len(self.owners)):
            self._free_if_done(row, keep)

    def _free_if_done(self, row: int, keep: set[int]) -> None:
        owner = self.owners[row]
        if owner is not None and id(owner) not in keep and not owner.is_running:
            owner.table_row, owner.pages_in_table = None, 0
            collector.free_when_idle(owner)  # often its last reference: freed when the engine is idle
            self.owners[row] = None
            self._free.append(row)

    def _take_row(self, r: Request, keep: set[int]) -> int:
        """A free row for r: its session's last row when free (its pages are mostly there), else the next.
        The session's row is freed here when its last request is done: rows are swept only when none is free,
        so without this a session's next turn took a new row and wrote all of its ~7.6k columns at 128k."""
        row = self._session_rows.get(r.session_id) if r.session_id is not None else None
        if row is not None:
            self._free_if_done(row, keep)
        if not self._free:
            raise RuntimeError(f"page table full: {len(self.owners)} rows, all running")
        if row is not None and row in self._free:
            self._free.remove(row)
        else:
            row = self._free.pop()
        if r.session_id is not None:
            self._session_rows[r.session_id] = row
            if len(self._session_rows) > 4 * len(self.owners):  # bounded: forget the oldest sessions
                for sid in list(self._session_rows)[: len(self._session_rows) // 2]:
                    del self._session_rows[sid]
        self.owners[row] = r
        return row

    def assign(self, reqs: list[Request]) -> tuple[list[int], list[int]]:
        """Rows for the step's requests, and the flat (row, column, page) triples to write first."""
        fresh = [r for r in reqs if r.table_row is None or self.owners[r.table_row] is not r]
        keep = {id(r) for r in reqs} if fresh else set()
        if len(fresh) > len(self._free):
            self._sweep(keep)
        rows: list[int] = []
        updates: list[int] = []
        for r in reqs:
            if r.table_row is None or self.owners[r.table_row] is not r:
                r.table_row = self._take_row(r, keep)
                r.pages_in_table = common_prefix(self.contents[r.table_row], r.pages)  # already in the row
            row, have, pages = r.table_row, r.pages_in_table, r.pages
            held = self.contents[row]
            del held[have:]
            for col in range(have, len(pages)):  # usually none; one when a decode crosses a page boundary
                updates += (row, col, pages[col])
                held.append(pages[col])
            r.pages_in_table = len(pages)
            rows.append(row)
        return rows, updates
