"""The disk tier: KV pages that leave the last in-memory tier are written here, not dropped, and a later turn
(or the next server, after a restart) reads them back instead of recomputing them.

Layout, under `root` (state_dir()/kvcache): one directory per namespace (disk_namespace.py: a hash of the
model, dtypes, KV layout, page size, tp), holding `index.json` and `chunks/<hash>.kv`.
- A page is named by the chained content hash of its token prefix (`chain`: blake2b over the previous
  page's hash and this page's tokens), so a page can only ever be found by a sequence that starts with the
  very tokens it was computed for.
- A chunk is a run of pages written together (one radix node's pages), page-major, named by its last
  page's hash, after a header naming its pages and its data's checksum (CRC-32, disk_index.py); the index
  keeps the same. A chunk whose bytes do not match is dropped and counted (`torn`), never served: the caller
  recomputes those tokens.
- The index is rewritten whole and atomically (temporary file, fsync, rename) after the chunk files it names
  are written and fsynced, so a crash at any instant leaves a consistent tier: the chunks written since the
  last index are adopted from their headers on the next start, and an index that does not parse is rebuilt
  from them; a file with no header that verifies is deleted and counted. Nothing read from the directory is
  trusted to name a path outside it (disk_index.py).
- Write-behind: a turn's new pages and its snapshot are written by a thread of their own (`write_behind`,
  disk_writer.py); until a write is done its pages count as on disk for what to write (`has`), not for reads.
- A model with per-sequence state (hybrid, Gemma 4) also keeps state snapshots here: one chunk per snapshot,
  named by the chained hash of the page its position ends on (`state`), checksummed and indexed like pages.
- Bounded: past `budget_bytes` (all namespaces together) other namespaces go first, then this one's least
  recently used chunks. A full disk is a logged warning, never a failed request.

On start the index is read (no data): the server serves at once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from agentbox.engine.cache.disk_index import INDEX, Chunk, load_chunks
from agentbox.engine.cache.disk_reader import ChunkReader, load
from agentbox.engine.cache.disk_writer import DiskWriter, Write, write_chunk
from agentbox.prefix import common_prefix

log = logging.getLogger(__name__)

SESSIONS = "sessions.json"
HASH_BYTES = 16
INDEX_EVERY_S = 0.5  # the index is rewritten at most this often while spilling (and at every flush)
READ_AHEAD = 2  # chunks read on the worker thread ahead of the one a restore copies in


def chain(prev: bytes, page: Sequence[int]) -> bytes:
    return hashlib.blake2b(prev + np.asarray(page, dtype=np.int64).tobytes(), digest_size=HASH_BYTES).digest()


@dataclass(frozen=True)
class PageRef:
    chunk: str
    index: int  # the page's place in its chunk


class HashMemo:
    """The chained hashes of the last few sequences hashed: an agent's next turn starts with the last one."""

    def __init__(self, keep: int = 8) -> None:
        self.keep = keep
        self._seqs: list[tuple[tuple[int, ...] | array, list[bytes]]] = []

    def hashes(self, toks: tuple[int, ...] | array, page_size: int, upto: int) -> list[bytes]:
        """The hashes of pages [0, upto) of toks (a tuple, or a prompt's int32 array: the same hashes)."""
        best, out = 0, []
        for seq, hs in self._seqs:
            k = min(common_prefix(seq, toks) // page_size, len(hs), upto)
            if k > best:
                best, out = k, hs
        hs = out[:best]
        for i in range(best, upto):
            hs.append(chain(hs[-1] if hs else b"", toks[i * page_size : (i + 1) * page_size]))
        self._seqs = [(toks[: upto * page_size], hs), *self._seqs[: self.keep - 1]]
        return hs


class DiskTier:
    def __init__(self, root: Path, namespace: str, meta: dict[str, object], page_bytes: int,
                 budget_bytes: int, restore: bool = True) -> None:
        self.root = root
        self.dir = root / namespace
        self.chunks_dir = self.dir / "chunks"
        self.namespace = namespace
        self.page_bytes = page_bytes
        self.budget = budget_bytes
        self.chunks: OrderedDict[str, Chunk] = OrderedDict()  # least recently used first
        self.pages: dict[str, PageRef] = {}
        self.states: dict[str, str] = {}  # page hash (hex) -> the chunk of the state snapshot at that page's end
        self.memo = HashMemo()
        self.reader = ChunkReader()
        self.torn = 0  # chunks dropped: unindexed leftovers of a crash, or bytes that fail their checksum
        self.written = 0  # pages written
        self.read = 0  # pages read back
        self.full_disk = 0  # writes skipped for lack of space
        self.writer = DiskWriter()
        self.pending: dict[str, Write] = {}  # chunk name -> its write-behind, queued or being written
        self._pending_pages: set[str] = set()  # their page hashes (hex)
        self._pending_states: set[str] = set()  # their snapshots' page hashes (hex)
        self._dirty = False
        self._last_index = 0.0
        self._others: int | None = None  # bytes of the other namespaces (measured once, then tracked)
        if not restore:
            shutil.rmtree(self.dir, ignore_errors=True)
        self.chunks_dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "meta.json").write_text(json.dumps(meta, indent=1))
        self._load()

    # ---- start ----

    def _load(self) -> None:
        found = load_chunks(self.dir, self.chunks_dir)
        self.torn = found.torn
        for c in found.chunks:
            self._add(c)
        if found.changed:
            self._dirty = True
            self.save_index()

    def _add(self, c: Chunk) -> None:
        self.chunks[c.name] = c
        for i, h in enumerate(c.pages):
            self.pages[h] = PageRef(c.name, i)
        if c.state:
            self.states[c.state] = c.name

    # ---- lookups (pure) ----

    def hashes(self, toks: tuple[int, ...] | array, page_size: int, upto: int) -> list[bytes]:
        return self.memo.hashes(toks, page_size, upto)

    def find(self, toks: tuple[int, ...] | array, page_size: int, first: int) -> list[tuple[str, PageRef]]:
        """The pages on disk continuing toks from page `first` (all of [first, k) for the largest k), with
        their hashes."""
        n = len(toks) // page_size
        if not self.pages or first >= n:
            return []
        hs = self.hashes(toks, page_size, first)  # the chain up to `first` (memoised), then page by page
        prev = hs[-1] if hs else b""
        out: list[tuple[str, PageRef]] = []
        for i in range(first, n):
            prev = chain(prev, toks[i * page_size : (i + 1) * page_size])
            h = prev.hex()
            ref = self.pages.get(h)
            if ref is None:
                break
            out.append((h, ref))
        return out

    def has(self, h: bytes) -> bool:
        """The page is on disk, or on its way there (a write-behind queued)."""
        return h.hex() in self.pages or h.hex() in self._pending_pages

    @property
    def bytes_used(self) -> int:
        return sum(c.file_bytes for c in self.chunks.values()) + sum(w.nbytes for w in self.pending.values())

    @property
    def num_pages(self) -> int:
        return len(self.pages)

    # ---- read ----

    def read_runs(self, refs: Sequence[PageRef]) -> Iterator[tuple[bytearray, list[int]]]:
        """refs' pages, in order: one (chunk bytes, the pages' places in it) per run of refs in one chunk. The
        next chunks are read on the worker thread while the caller copies this one in (disk_reader.py). Stops
        at the first chunk that is missing or fails its checksum (that chunk is dropped and counted)."""
        runs: list[tuple[str, list[int]]] = []
        for ref in refs:
            if runs and runs[-1][0] == ref.chunk:
                runs[-1][1].append(ref.index)
            else:
                runs.append((ref.chunk, [ref.index]))
        now = time.time()
        for i, (name, idx) in enumerate(runs):
            for ahead, _ in runs[i + 1 : i + 1 + READ_AHEAD]:
                self._ask(ahead)
            data = self._read_chunk(name)
            if data is None:
                return
            c = self.chunks[name]
            c.used = now
            self.chunks.move_to_end(name)
            self.read += len(idx)
            self._dirty = True
            yield data, idx

    def prefetch(self, refs: Sequence[PageRef]) -> None:
        """Start reading refs' first chunks on the worker threads (a request that will restore them arrived),
        as many as the read-ahead bound takes."""
        for name in dict.fromkeys(r.chunk for r in refs):
            if not self._ask(name, make_room=False):
                break

    def _ask(self, name: str, make_room: bool = True) -> bool:
        c = self.chunks.get(name)
        return c is not None and self.reader.ask(name, self.chunks_dir / f"{name}.kv", c.nbytes, c.sum, make_room,
                                                 c.offset)

    def _read_chunk(self, name: str) -> bytearray | None:
        c = self.chunks.get(name)
        if c is None:
            return None
        asked, data = self.reader.take(name, c.sum)
        if not asked:
            data = load(self.chunks_dir / f"{name}.kv", c.nbytes, c.sum, c.offset)
        if data is None:
            log.warning("disk KV tier: chunk %s is torn or corrupt; dropped (its tokens are recomputed)", name)
            self._drop(c)
            self.torn += 1
            self.save_index()
        return data

    # ---- write ----

    def write(self, hashes: Sequence[bytes], data: bytes) -> bool:
        """Write one chunk: pages named by `hashes`, `data` their bytes page-major. False when skipped
        (over the budget alone, or the disk is full)."""
        if len(data) != len(hashes) * self.page_bytes:
            raise ValueError(f"{len(hashes)} pages but {len(data)} bytes")
        if not hashes or not self._write(hashes[-1].hex(), data, [h.hex() for h in hashes]):
            return False
        self.written += len(hashes)
        return True

    def write_state(self, h: bytes, data: bytes) -> bool:
        """Write the state snapshot at the end of the page whose hash is h. False when skipped."""
        return self._write("s" + h.hex(), data, [], h.hex())

    def has_state(self, h: bytes) -> bool:
        """A snapshot at that page's end is on disk, or on its way there."""
        return h.hex() in self.states or h.hex() in self._pending_states

    def read_state(self, h: bytes) -> bytes | None:
        """The state snapshot at the end of page h, or None (none, or its chunk is torn: dropped, counted)."""
        name = self.states.get(h.hex())
        data = self._read_chunk(name) if name is not None else None
        if data is None:
            return None
        self.chunks[name].used = time.time()
        self.chunks.move_to_end(name)
        self._dirty = True
        return bytes(data)

    def _write(self, name: str, data: bytes, pages: list[str], state: str = "") -> bool:
        n = len(data)
        if n > self.budget or not self._make_room(n):
            return False
        w = Write(name, self.chunks_dir / f"{name}.kv", data, pages, state)
        write_chunk(w, ".tmp")
        return self._landed(w)

    def _landed(self, w: Write) -> bool:
        """A write is done (here, or on the writer's thread): index it, or say why it is not there."""
        if not w.ok:
            self.full_disk += 1
            if self.full_disk == 1 or self.full_disk % 100 == 0:
                why = w.error.strerror if w.error is not None else "unknown"
                log.warning("disk KV tier: could not write %s (%s); pages are dropped instead (%d so far). "
                            "Free space under %s or lower --disk-cache-gb", w.path.name, why, self.full_disk,
                            self.root)
            return False
        now = time.time()
        old = self.chunks.get(w.name)
        if old is not None:
            self._drop(old, unlink=False)
        self._add(Chunk(w.name, w.pages, w.sum, w.nbytes, w.created, now, w.state, w.offset))
        self._dirty = True
        if now - self._last_index >= INDEX_EVERY_S:
            self.save_index()
        return True

    # ---- write-behind (disk_writer.py) ----

    def write_behind(self, hashes: Sequence[bytes], data: bytes) -> bool:
        """Queue one chunk (as `write`) for the writer thread. False when skipped (over the budget alone)."""
        if len(data) != len(hashes) * self.page_bytes:
            raise ValueError(f"{len(hashes)} pages but {len(data)} bytes")
        return bool(hashes) and self._queue(hashes[-1].hex(), data, [h.hex() for h in hashes])

    def write_state_behind(self, h: bytes, data: bytes) -> bool:
        """Queue the state snapshot at the end of page h for the writer thread."""
        return self._queue("s" + h.hex(), data, [], h.hex())

    def _queue(self, name: str, data: bytes, pages: list[str], state: str = "") -> bool:
        self.collect()
        if name in self.pending or len(data) > self.budget or not self._make_room(len(data)):
            return False
        w = Write(name, self.chunks_dir / f"{name}.kv", data, pages, state)
        self.pending[name] = w
        self._pending_pages.update(pages)
        if state:
            self._pending_states.add(state)
        for gone in self.writer.submit(w):  # the disk is slower than the turns: the oldest queued go first
            self._unpend(gone)
        return name in self.pending

    def _unpend(self, w: Write) -> None:
        if self.pending.get(w.name) is w:
            del self.pending[w.name]
            self._pending_pages.difference_update(w.pages)
            self._pending_states.discard(w.state)

    def collect(self) -> int:
        """Index the writes the writer thread finished (on the engine thread). Returns pages indexed."""
        n = 0
        for w in self.writer.take_done():
            if w.sidecar:
                continue
            self._unpend(w)
            if self._landed(w):
                self.written += len(w.pages)
                n += len(w.pages)
        return n

    def finish_writes(self, timeout: float) -> bool:
        """Wait up to timeout seconds for the queued writes, then index them. False when some were left."""
        done = self.writer.wait(timeout)
        self.collect()
        return done

    def _make_room(self, n: int) -> bool:
        over = self._total_bytes() + n - self.budget
        for other in self._other_namespaces():  # stale models first, oldest first
            if over <= 0:
                break
            size = _dir_bytes(other)
            over -= size
            self._others = (self._others or 0) - size
            shutil.rmtree(other, ignore_errors=True)
            log.info("disk KV tier: evicted the namespace %s (another model or setting)", other.name)
        while over > 0 and self.chunks:
            c = next(iter(self.chunks.values()))
            over -= c.file_bytes
            self._drop(c)
        return over <= 0

    def _drop(self, c: Chunk, unlink: bool = True) -> None:
        self.chunks.pop(c.name, None)
        for i, h in enumerate(c.pages):
            if self.pages.get(h) == PageRef(c.name, i):
                del self.pages[h]
        self.reader.forget(c.name)
        if c.state and self.states.get(c.state) == c.name:
            del self.states[c.state]
        if unlink:
            (self.chunks_dir / f"{c.name}.kv").unlink(missing_ok=True)
        self._dirty = True

    def _other_namespaces(self) -> list[Path]:
        others = [p for p in self.root.iterdir() if p.is_dir() and p != self.dir]
        return sorted(others, key=lambda p: _mtime(p / INDEX))

    def _total_bytes(self) -> int:
        if self._others is None:
            self._others = sum(_dir_bytes(p) for p in self._other_namespaces())
        return self.bytes_used + self._others

    def save_index(self) -> None:
        """Rewrite the index atomically: a temporary file, fsync, rename (then the directory's fsync). It names
        only chunks whose files are written (a write-behind is indexed once it is done: `collect`)."""
        body = json.dumps({"chunks": [c.__dict__ for c in self.chunks.values()]})
        tmp = self.dir / (INDEX + ".tmp")
        try:
            with open(tmp, "w") as f:
                f.write(body)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.dir / INDEX)
            fd = os.open(self.dir, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            log.warning("disk KV tier: could not write its index (%s); the last chunks may be lost", e.strerror)
            return
        self._dirty = False
        self._last_index = time.time()

    def clear(self) -> None:
        self.finish_writes(60.0)
        for c in list(self.chunks.values()):
            self._drop(c)
        self.save_index()


def _dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def _mtime(p: Path) -> float:
    try:
        return p.stat().st_mtime
    except OSError:
        return 0.0
