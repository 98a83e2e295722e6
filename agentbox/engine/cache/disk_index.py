"""What the disk tier reads of its own directory at start, treated as untrusted input (disk_tier.py has the tier).

- A chunk file carries its own header before its data: a magic, the header's length and CRC-32, then JSON
  naming its pages (their hashes), its state snapshot's page hash when it is one, its data's length and CRC-32
  and when it was written. So the index is a cache of what the chunks say: chunks a crash left unindexed (the
  write-behind's, written after the last index: radix_disk.py) are adopted from their headers, and an index that
  does not parse is rebuilt from them, with a log line counting what came back.
- Every name read from the index must be a chunk name this tier makes (a page hash in hex, `s` before it for a
  snapshot), and every path built from one must resolve inside the chunks directory: an entry such as
  `../../../victim` is refused with a log line, so no file outside the directory is ever read or deleted.
"""

from __future__ import annotations

import json
import logging
import re
import struct
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

INDEX = "index.json"
MAGIC = b"ABKV"
PREFIX = struct.Struct("<4sII")  # magic, header length, the header's CRC-32
MAX_HEADER = 1 << 20  # a chunk of 64 pages names them in about 2.3 KB
HASH_HEX = 32  # disk_tier.HASH_BYTES in hex
_NAME = re.compile(rf"s?[0-9a-f]{{{HASH_HEX}}}")
_HASH = re.compile(rf"[0-9a-f]{{{HASH_HEX}}}")


@dataclass
class Chunk:
    name: str
    pages: list[str]  # page hashes (hex), in order
    sum: str  # CRC-32 of the data (after the header)
    nbytes: int  # the data's length
    created: float
    used: float
    state: str = ""  # a state snapshot's chunk: the hash (hex) of the page its position ends on
    offset: int = 0  # where the data starts in the file (the header's length)

    @property
    def file_bytes(self) -> int:
        return self.offset + self.nbytes


def header(pages: list[str], state: str, data_sum: str, nbytes: int, created: float) -> bytes:
    """The bytes a chunk file starts with (its data follows)."""
    body = json.dumps({"pages": pages, "state": state, "sum": data_sum, "nbytes": nbytes,
                       "created": created}).encode()
    return PREFIX.pack(MAGIC, len(body), zlib.crc32(body)) + body


def valid_name(name: object) -> bool:
    return isinstance(name, str) and _NAME.fullmatch(name) is not None


def confined(directory: Path, name: str) -> Path | None:
    """directory / name when the name is a chunk name and the path resolves inside directory; else None, logged."""
    path = directory / f"{name}.kv"
    if valid_name(name) and path.resolve().parent == directory.resolve():
        return path
    log.warning("disk KV tier: refused %r: not a chunk name of this tier, or not a file inside %s", str(name)[:200],
                directory)
    return None


def _chunk(d: object) -> Chunk | None:
    """An index entry as a Chunk when every field has the type and shape this tier writes; else None."""
    if not isinstance(d, dict):
        return None
    pages, state = d.get("pages"), d.get("state", "")
    ok = (valid_name(d.get("name")) and isinstance(pages, list) and all(
        isinstance(h, str) and _HASH.fullmatch(h) for h in pages) and isinstance(state, str)
        and (state == "" or _HASH.fullmatch(state) is not None) and isinstance(d.get("sum"), str)
        and all(isinstance(d.get(k), int) and not isinstance(d.get(k), bool) and d[k] >= 0
                for k in ("nbytes", "offset"))
        and all(isinstance(d.get(k), int | float) for k in ("created", "used")))
    if not ok:
        return None
    return Chunk(d["name"], list(pages), d["sum"], d["nbytes"], float(d["created"]), float(d["used"]), state,
                 d["offset"])


def read_index(directory: Path) -> tuple[list[Chunk] | None, int]:
    """The index's chunks (None when the file is there but does not parse as an index: rebuild), and how many
    entries were refused (bad shape, or a name that leads outside)."""
    try:
        raw = json.loads((directory / INDEX).read_text())
    except FileNotFoundError:
        return [], 0
    except (OSError, ValueError, UnicodeDecodeError) as e:
        log.warning("disk KV tier: %s is unreadable (%s); rebuilding it from the chunks' own headers",
                    directory / INDEX, type(e).__name__)
        return None, 0
    entries = raw.get("chunks") if isinstance(raw, dict) else None
    if not isinstance(entries, list):
        log.warning("disk KV tier: %s is not an index; rebuilding it from the chunks' own headers", directory / INDEX)
        return None, 0
    out, refused = [], 0
    for d in entries:
        c = _chunk(d)
        if c is None:
            refused += 1
            if isinstance(d, dict) and isinstance(d.get("name"), str) and not valid_name(d["name"]):
                log.warning("disk KV tier: refused the index entry %r, which would lead outside %s",
                            d["name"][:200], directory)
            continue
        out.append(c)
    return out, refused


def read_header(path: Path) -> Chunk | None:
    """The chunk a file's own header describes (its size checked), or None when it has none that verifies."""
    try:
        with open(path, "rb") as f:
            prefix = f.read(PREFIX.size)
            if len(prefix) != PREFIX.size:
                return None
            magic, n, crc = PREFIX.unpack(prefix)
            if magic != MAGIC or n > MAX_HEADER:
                return None
            body = f.read(n)
            size = f.seek(0, 2)
    except OSError:
        return None
    if len(body) != n or zlib.crc32(body) != crc:
        return None
    try:
        d = json.loads(body)
    except ValueError:
        return None
    if not isinstance(d, dict):
        return None
    now = time.time()
    c = _chunk({**d, "name": path.stem, "offset": PREFIX.size + n, "used": d.get("created", now)})
    return c if c is not None and c.file_bytes == size else None


@dataclass
class Found:
    """What a start found: the chunks to index (least recently used first), the files dropped, and whether the
    index must be written again (it was rebuilt, or chunks were adopted or entries refused)."""

    chunks: list[Chunk]
    torn: int
    changed: bool


def load_chunks(directory: Path, chunks_dir: Path) -> Found:
    """The tier's chunks from its index, checked against their files, plus the unindexed files whose headers
    verify (adopted); any other file in chunks_dir is deleted and counted. Each outcome is logged with counts."""
    indexed, refused = read_index(directory)
    rebuild = indexed is None
    kept: dict[str, Chunk] = {}
    torn = 0
    for c in sorted(indexed or [], key=lambda c: c.used):
        p = confined(chunks_dir, c.name)
        if p is None or not p.is_file() or p.stat().st_size != c.file_bytes:
            torn += 1
            continue
        kept[c.name] = c
    adopted = []
    for p in sorted(chunks_dir.iterdir()):  # unindexed: the write-behind's since the last index, or leftovers
        if p.suffix == ".kv" and p.stem in kept:
            continue
        c = read_header(p) if p.suffix == ".kv" and confined(chunks_dir, p.stem) is not None else None
        if c is None:
            p.unlink(missing_ok=True)  # a crash's temporary, or a file with no header that verifies
            torn += 1
        else:
            adopted.append(c)
    adopted.sort(key=lambda c: c.created)
    chunks = [*kept.values(), *adopted]
    pages = sum(len(c.pages) for c in chunks)
    if rebuild:
        log.warning("disk KV tier: index rebuilt from the chunks' own headers: %d chunks (%d pages, %d state "
                    "snapshots) came back, %d unreadable files dropped", len(chunks), pages,
                    sum(bool(c.state) for c in chunks), torn)
    elif adopted:
        log.info("disk KV tier: %d chunks written after the last index (%d pages) adopted from their headers",
                 len(adopted), sum(len(c.pages) for c in adopted))
    if refused:
        log.warning("disk KV tier: %d index entries refused (malformed, or naming a path outside %s)", refused,
                    chunks_dir)
    if torn and not rebuild:
        log.warning("disk KV tier: dropped %d torn or unindexed chunks (recomputed when needed)", torn)
    return Found(chunks, torn, rebuild or bool(adopted) or bool(refused))
