"""Chunk files written on a thread of their own: the disk tier's write-behind (radix_disk.py queues a turn's new
pages and its state snapshot here when the turn ends), so no request waits on a write or an fsync.

The thread only writes files (the header and data to a temporary, fsync, rename) and computes the data's
checksum; everything the tier owns (its index, its counters, its budget) stays with the engine thread, which
takes the finished writes back (`take_done`) and indexes them. A chunk written but not indexed yet is safe: its
header names its pages (disk_index.py), so after a crash the next start adopts it.

Bounded: the bytes queued and not yet written are at most QUEUE_BYTES; past that the oldest queued write is
dropped first (the disk is slower than the turns: the newest turns are the ones their agents come back to), and
counted.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from agentbox.engine.cache.disk_index import header
from agentbox.engine.cache.disk_reader import checksum

QUEUE_BYTES = 512 * 2**20  # written-behind bytes waiting for the disk, at most (a turn of a 27B model: ~50 MB)


@dataclass
class Write:
    """One chunk to write: `pages` its page hashes (hex), `state` a snapshot's page hash; after the write,
    `sum`, `offset` and `ok` say what landed (`error`: why not)."""

    name: str
    path: Path
    data: bytes
    pages: list[str]
    state: str = ""
    created: float = field(default_factory=time.time)
    sidecar: bool = False  # a file beside the chunks (the session table): written as it is, never indexed
    sum: str = ""
    offset: int = 0
    ok: bool = False
    error: OSError | None = None
    nbytes: int = field(init=False)  # the data's length (the data itself is let go once written)

    def __post_init__(self) -> None:
        self.nbytes = len(self.data)


class DiskWriter:
    def __init__(self, queue_bytes: int = QUEUE_BYTES) -> None:
        self.queue_bytes = queue_bytes
        self._queue: deque[Write] = deque()
        self._done: list[Write] = []
        self._queued = 0  # bytes in _queue
        self._busy = False  # the thread holds a write
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None  # started with the first write
        self.dropped = 0  # writes dropped because the queue was full

    def submit(self, w: Write) -> list[Write]:
        """Queue w; returns the queued writes dropped to make room for it (oldest first; w itself when it alone
        is larger than the queue)."""
        if w.nbytes > self.queue_bytes:
            self.dropped += 1
            return [w]
        dropped = []
        with self._cv:
            if w.sidecar:  # only its newest content matters: it replaces a queued one
                for old in [q for q in self._queue if q.sidecar and q.path == w.path]:
                    self._queue.remove(old)
                    self._queued -= old.nbytes
            while self._queue and self._queued + w.nbytes > self.queue_bytes:
                old = self._queue.popleft()
                self._queued -= old.nbytes
                dropped.append(old)
            self._queue.append(w)
            self._queued += w.nbytes
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="disk-kv-write", daemon=True)
                self._thread.start()
            self._cv.notify()
        self.dropped += len(dropped)
        return dropped

    def take_done(self) -> list[Write]:
        """The writes finished since the last call (ok or not), in the order they were queued."""
        with self._cv:
            out, self._done = self._done, []
        return out

    @property
    def pending(self) -> int:
        """Writes queued or being written."""
        with self._cv:
            return len(self._queue) + self._busy

    def wait(self, timeout: float) -> bool:
        """Block until every queued write is done (True) or timeout seconds passed (False)."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue:
                    self._cv.wait()  # idle means blocked
                w = self._queue.popleft()
                self._queued -= w.nbytes
                self._busy = True
            write_chunk(w)
            w.data = b""  # written (or failed): the bytes need not wait for the engine thread to take it
            with self._cv:
                self._busy = False
                self._done.append(w)
                self._cv.notify_all()


def write_chunk(w: Write, tmp_suffix: str = ".wb.tmp") -> None:
    """Header and data (a sidecar: its data alone) to a temporary, fsync, rename over w.path; sets w's sum,
    offset and ok (or error)."""
    w.sum = checksum(w.data)
    head = b"" if w.sidecar else header(w.pages, w.state, w.sum, w.nbytes, w.created)
    w.offset = len(head)
    tmp = w.path.with_suffix(tmp_suffix)  # the thread's and the engine thread's differ
    try:
        with open(tmp, "wb") as f:
            f.write(head)
            f.write(w.data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, w.path)
        w.ok = True
    except OSError as e:
        tmp.unlink(missing_ok=True)
        w.error = e
