"""The session table across a restart: at a graceful stop each session's counters, gaps and history hashes
are written beside the disk tier's index (atomically, like it), with the prefix hash its history ends on;
on start they come back under their ids, shown "on disk" until the session returns."""

from __future__ import annotations

import json
import os
from pathlib import Path

from agentbox.engine.cache.sessions import Session, SessionTable
from agentbox.engine.cache.turns import Turns

# What a session carries over a restart (its lease does not: the clock it ran on is gone).
FIELDS = ("turns", "prompt_tokens", "cached_tokens_gpu", "cached_tokens_host", "recomputed_tokens",
          "history_tokens", "history_hashes", "last_prompt_tokens", "last_sequence_tokens", "last_ttft_s")


def save_sessions(path: Path, table: SessionTable, ends: dict[str, tuple[str, int]]) -> None:
    """`ends`: per session, the disk hash its cached history ends on and that history's tokens."""
    rows = []
    for s in table:
        row: dict[str, object] = {"id": s.id, "gaps": list(s.gaps), **{f: getattr(s, f) for f in FIELDS}}
        if s.id in ends:
            row["end_hash"], row["on_disk_tokens"] = ends[s.id]
        rows.append(row)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        json.dump({"sessions": rows}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_sessions(path: Path, turns: Turns) -> dict[str, tuple[str, int]]:
    """Recreate the saved sessions in the table; returns their (end hash, tokens) on disk."""
    try:
        rows = json.loads(path.read_text()).get("sessions", [])
    except (OSError, ValueError):
        return {}
    ends: dict[str, tuple[str, int]] = {}
    for row in rows:
        s: Session = turns.restore(str(row["id"]), {f: row[f] for f in FIELDS if f in row}, row.get("gaps", []))
        if "end_hash" in row:
            ends[s.id] = (str(row["end_hash"]), int(row["on_disk_tokens"]))
    return ends
