"""What is on disk, read without an engine (no torch): the namespaces under state_dir()/kvcache with their
model, size, chunks and oldest entry, for `agentbox cache`; and clearing them."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from agentbox.config import state_dir
from agentbox.engine.cache.disk_index import read_index


def disk_root() -> Path:
    return state_dir() / "kvcache"


@dataclass(frozen=True)
class NamespaceInfo:
    key: str
    model: str
    dtype: str
    page_size: int
    bytes: int
    chunks: int
    pages: int
    sessions: int
    oldest: float | None  # when its oldest chunk was written (epoch seconds)


def _json(p: Path) -> dict:
    try:
        d = json.loads(p.read_text())
    except (OSError, ValueError):
        return {}
    return d if isinstance(d, dict) else {}


def namespaces(root: Path | None = None) -> list[NamespaceInfo]:
    root = root or disk_root()
    out = []
    for d in sorted(p for p in (root.iterdir() if root.is_dir() else []) if p.is_dir()):
        meta = _json(d / "meta.json")
        chunks = read_index(d)[0] or []  # validated entries only: the files are untrusted (disk_index.py)
        sessions = _json(d / "sessions.json").get("sessions", [])
        page_size = meta.get("page_size", 0)
        out.append(NamespaceInfo(
            key=d.name, model=str(meta.get("model", "?")), dtype=str(meta.get("kv_dtype", "?")),
            page_size=page_size if isinstance(page_size, int) else 0,
            bytes=sum(f.stat().st_size for f in d.rglob("*") if f.is_file()),
            chunks=len(chunks), pages=sum(len(c.pages) for c in chunks),
            sessions=len(sessions) if isinstance(sessions, list) else 0,
            oldest=min((c.created for c in chunks), default=None),
        ))
    return out


def clear(key: str | None = None, root: Path | None = None) -> list[str]:
    """Remove one namespace (key, or a prefix of it) or all; returns the keys removed."""
    root = root or disk_root()
    gone = []
    for ns in namespaces(root):
        if key is None or ns.key.startswith(key):
            shutil.rmtree(root / ns.key, ignore_errors=True)
            gone.append(ns.key)
    return gone
