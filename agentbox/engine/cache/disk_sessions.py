"""The session table across a restart: each session's counters, gaps and history hashes are written beside the
disk tier's index (atomically, like it), with the prefix hash its history ends on, at a graceful stop and, written
behind, at every turn's end (radix_disk.py); on start they come back under their ids, shown "on disk" until the
session returns."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from agentbox.engine.cache.sessions import Session, SessionTable
from agentbox.engine.cache.turns import Turns

log = logging.getLogger(__name__)

# What a session carries over a restart (its lease does not: the clock it ran on is gone).
FIELDS = ("turns", "prompt_tokens", "cached_tokens_gpu", "cached_tokens_host", "recomputed_tokens",
          "history_tokens", "history_hashes", "last_prompt_tokens", "last_sequence_tokens", "last_ttft_s")


def session_row(s: Session, end: tuple[str, int] | None) -> str:
    """One session's row, as JSON text: `end` is the disk hash its cached history ends on and that history's
    tokens (None: not on disk)."""
    row: dict[str, object] = {"id": s.id, "gaps": list(s.gaps), **{f: getattr(s, f) for f in FIELDS}}
    if end is not None:
        row["end_hash"], row["on_disk_tokens"] = end
    return json.dumps(row)


def sessions_file(rows: list[str]) -> bytes:
    """The file's bytes from its rows (session_row's text, kept per session between writes)."""
    return ('{"sessions": [' + ", ".join(rows) + "]}").encode()


def save_sessions(path: Path, table: SessionTable, ends: dict[str, tuple[str, int]]) -> None:
    """`ends`: per session, the disk hash its cached history ends on and that history's tokens."""
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(sessions_file([session_row(s, ends.get(s.id)) for s in table]))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_sessions(path: Path, turns: Turns) -> dict[str, tuple[str, int]]:
    """Recreate the saved sessions in the table; returns their (end hash, tokens) on disk. The file is untrusted:
    a row whose fields are not what `save_sessions` writes is skipped, and the log counts them."""
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, UnicodeDecodeError) as e:
        log.warning("the saved session table %s is unreadable (%s); sessions start afresh", path, type(e).__name__)
        return {}
    rows = raw.get("sessions") if isinstance(raw, dict) else None
    ends: dict[str, tuple[str, int]] = {}
    bad = 0
    for row in rows if isinstance(rows, list) else []:
        if not _valid(row):
            bad += 1
            continue
        s: Session = turns.restore(row["id"], {f: row[f] for f in FIELDS if f in row}, row.get("gaps", []))
        if "end_hash" in row:
            ends[s.id] = (row["end_hash"], row["on_disk_tokens"])
    if bad or not isinstance(rows, list):
        log.warning("the saved session table %s: %d malformed rows skipped", path, bad)
    return ends


def _num(v: object, kind: type | tuple[type, ...] = int) -> bool:
    return isinstance(v, kind) and not isinstance(v, bool)


def _valid(row: object) -> bool:
    """A row as save_sessions writes it: an id, numbers where numbers go, and an end hash with its tokens."""
    if not isinstance(row, dict) or not isinstance(row.get("id"), str) or not row["id"]:
        return False
    for f in FIELDS:
        v = row.get(f, 0)
        if f == "history_hashes":
            if not isinstance(v, list) or not all(_num(x) for x in v):
                return False
        elif f == "last_ttft_s":
            if v is not None and not _num(v, (int, float)):
                return False
        elif not _num(v) or v < 0:
            return False
    gaps = row.get("gaps", [])
    if not isinstance(gaps, list) or not all(_num(g, (int, float)) for g in gaps):
        return False
    if "end_hash" in row:
        return isinstance(row["end_hash"], str) and _num(row.get("on_disk_tokens")) and row["on_disk_tokens"] >= 0
    return True
