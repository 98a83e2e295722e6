"""Per-session memo of the chained page hashes (sessions.page_hashes) of the last sequence hashed.

Counting a turn's recomputed history hashes its whole prompt, and finishing it hashes the whole sequence:
a Python loop over every page of the history, ~8k pages at 128k tokens, on every turn. An agent's turn
N+1 starts with turn N's sequence, so the hashes of the pages they share are the ones already computed:
the memo keeps the last sequence (a tuple: shared references to the same ints) and its hashes, finds the
common prefix with C-speed slice compares, and hashes only the pages after it. Same hashes, bounded memory
(the most recent `max_sessions` sessions).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence

from agentbox.prefix import common_prefix


class PageHashMemo:
    def __init__(self, max_sessions: int = 64) -> None:
        self.max_sessions = max_sessions
        self._last: OrderedDict[str, tuple[tuple[int, ...] | array, list[int]]] = OrderedDict()

    def hashes(self, sid: str, tokens: Sequence[int], page_size: int) -> list[int]:
        """page_hashes(tokens, page_size), reusing the pages shared with this session's last sequence. An int32
        array (a prompt from the API process) is kept as one: two arrays' common prefix is a C loop over 4-byte
        ints, ~10x the tuples' object compare. A page is hashed as a tuple of ints whatever it came in."""
        toks = tokens if isinstance(tokens, tuple | array) else tuple(tokens)
        old = self._last.pop(sid, None)
        keep = 0
        if old is not None:
            keep = min(common_prefix(old[0], toks) // page_size, len(old[1]))
        out = old[1][:keep] if old is not None else []
        h = out[-1] if out else 0
        page = tuple if isinstance(toks, array) else None
        for i in range(keep, len(toks) // page_size):
            ids = toks[i * page_size : (i + 1) * page_size]
            h = hash((h, ids if page is None else page(ids)))
            out.append(h)
        self._last[sid] = (toks, out)
        while len(self._last) > self.max_sessions:
            self._last.popitem(last=False)
        return list(out)

    def forget(self, sid: str) -> None:
        self._last.pop(sid, None)
