"""The rows a running request holds: its row of the runner's persistent page table and, for a model with a state
group, its live state slot (the same index). The cache hands them out with a lock and takes them back when the
request's pages go back (manager.py).

A session's next request takes the row its last one held when it is free: the runner's table row still holds
that request's pages (nothing clears a free row), and a warm turn's pages start with the last turn's (its locked
prefix), so only the columns after the first difference are written, not ~7.5k at 128k tokens. Any other request
takes the row freed longest ago (the least likely to be some session's next), not the one just freed.
"""

from __future__ import annotations

from collections import deque


class RowPool:
    def __init__(self, num_rows: int) -> None:
        self.num_rows = num_rows
        self._free = deque(range(num_rows))  # freed longest ago first
        self._session_rows: dict[str, int] = {}  # the row a session's last request held

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, session: str | None) -> int:
        if not self._free:
            raise RuntimeError(f"no free row: {self.num_rows} rows, all running")
        row = self._session_rows.get(session) if session is not None else None
        if row is not None and row in self._free:
            self._free.remove(row)
        else:
            row = self._free.popleft()
        if session is not None:
            self._session_rows[session] = row
            if len(self._session_rows) > 4 * self.num_rows:  # bounded: forget the oldest sessions
                for sid in list(self._session_rows)[: len(self._session_rows) // 2]:
                    del self._session_rows[sid]
        return row

    def give_back(self, row: int) -> None:
        if row in self._free:
            raise RuntimeError(f"row {row} given back twice")
        self._free.append(row)
