"""Write a client's config file safely: merge, back up first, show a diff, undo from the backup.

A file that setup created has no backup to restore: agentbox's state dir remembers it (setup-created.json),
so undo deletes it without leaving marker files beside the user's configs."""

from __future__ import annotations

import difflib
import json
import os
import shutil
import time
from pathlib import Path

from agentbox.config import state_dir

BACKUP_TAG = ".agentbox-backup-"
OLD_ABSENT = ".absent"  # markers earlier versions left for "there was no file"; undo still honours them
PRIVATE_MODE = 0o600


def unified_diff(path: Path, old: str, new: str) -> str:
    return "".join(
        difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"{path} (current)", f"{path} (new)")
    )


def backups(path: Path) -> list[Path]:
    """Backups of `path`, oldest first (timestamps sort as text)."""
    return sorted(path.parent.glob(path.name + BACKUP_TAG + "*"))


def _ledger() -> Path:
    return state_dir() / "setup-created.json"


def _created() -> list[str]:
    try:
        data = json.loads(_ledger().read_text())
    except (OSError, ValueError):
        return []
    return [str(p) for p in data] if isinstance(data, list) else []


def _remember_created(path: Path, created: bool) -> None:
    paths = [p for p in _created() if p != str(path)] + ([str(path)] if created else [])
    _ledger().parent.mkdir(parents=True, exist_ok=True)
    _ledger().write_text(json.dumps(paths, indent=1))


def backup(path: Path) -> Path:
    """Copy an existing `path` beside itself, readable by its owner only (an old config may hold a key)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    n = 0
    while (target := path.with_name(f"{path.name}{BACKUP_TAG}{stamp}-{n:02d}")).exists():
        n += 1
    shutil.copy2(path, target)
    target.chmod(PRIVATE_MODE)
    return target


def write_with_backup(path: Path, text: str, *, private: bool = False) -> tuple[bool, Path | None]:
    """Write text to path after backing up what is there: (changed, the backup or None for a new file).
    `private` (the text holds a secret) writes the file, and keeps it, readable by its owner only."""
    old = path.read_text() if path.exists() else None
    if old == text:
        if private:
            path.chmod(PRIVATE_MODE)
        return False, None
    saved = backup(path) if old is not None else None
    if old is None:
        _remember_created(path, True)
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = PRIVATE_MODE if private else (path.stat().st_mode & 0o777 if old is not None else 0o666)
    tmp = path.with_name(path.name + ".agentbox-tmp")
    tmp.unlink(missing_ok=True)
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), "w") as f:
        f.write(text)
    if private:
        tmp.chmod(PRIVATE_MODE)  # whatever the umask
    tmp.replace(path)
    return True, saved


def describe_undo(path: Path) -> str:
    found = backups(path)
    if found:
        return f"would restore {found[-1]}"
    if str(path) in _created() and path.exists():
        return f"would remove {path} (agentbox setup created it)"
    return f"no agentbox backup of {path}"


def undo(path: Path) -> str:
    """Restore the latest backup of path (removing that backup), or remove a file setup created; the line to
    show. FileNotFoundError when there is neither."""
    found = backups(path)
    if found:
        latest = found[-1]
        if latest.name.endswith(OLD_ABSENT):
            path.unlink(missing_ok=True)
            latest.unlink()
            return f"removed {path} (agentbox setup created it)"
        mode = path.stat().st_mode & 0o777 if path.exists() else None
        latest.replace(path)
        if mode is not None:
            path.chmod(mode)  # the file keeps its own mode; the backup's is private
        return f"restored {path} from {latest.name}"
    if str(path) in _created():
        path.unlink(missing_ok=True)
        _remember_created(path, False)
        return f"removed {path} (agentbox setup created it)"
    raise FileNotFoundError(f"no agentbox backup of {path}")
