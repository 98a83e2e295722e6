"""Write a client's config file safely: merge, back up first, show a diff, undo from the backup."""

from __future__ import annotations

import difflib
import time
from pathlib import Path

BACKUP_TAG = ".agentbox-backup-"
ABSENT = ".absent"  # a backup that records "there was no file": undo deletes what setup created


def unified_diff(path: Path, old: str, new: str) -> str:
    return "".join(
        difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"{path} (current)", f"{path} (new)")
    )


def backups(path: Path) -> list[Path]:
    """Backups of `path`, oldest first (timestamps sort as text)."""
    return sorted(path.parent.glob(path.name + BACKUP_TAG + "*"))


def backup(path: Path) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    n = 0
    while True:
        suffix = f"{stamp}-{n:02d}"
        target = path.with_name(path.name + BACKUP_TAG + suffix + ("" if path.exists() else ABSENT))
        if not target.exists() and not target.with_name(target.name + ABSENT).exists():
            break
        n += 1
    target.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        target.write_bytes(path.read_bytes())
    else:
        target.touch()
    return target


def write_with_backup(path: Path, text: str) -> Path | None:
    """Write text to path after backing up what is there; None (and no write) when nothing changes."""
    old = path.read_text() if path.exists() else None
    if old == text:
        return None
    saved = backup(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".agentbox-tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return saved


def undo(path: Path) -> Path:
    """Restore the latest backup of path (removing that backup); raises FileNotFoundError if none."""
    found = backups(path)
    if not found:
        raise FileNotFoundError(f"no agentbox backup of {path}")
    latest = found[-1]
    if latest.name.endswith(ABSENT):
        path.unlink(missing_ok=True)
    else:
        latest.replace(path)
    latest.unlink(missing_ok=True)
    return latest
