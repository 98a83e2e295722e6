"""The state directory (config.state_dir()) as untrusted input: anything there may be truncated, garbled or
planted, and agentbox must neither crash on it nor follow it out of the directory.

- `inside`: a path named by a file of the state directory is used only when it resolves inside the directory it
  belongs to; otherwise it is refused with a log line.
- `seal` / `check_seal`: a directory of derived files (a converted tokenizer with its chat template) carries a
  manifest of their SHA-256 sums, written last; one that does not verify is rebuilt from the model, not trusted.
- `sealed_json` / `read_sealed_json`: one JSON file (the canary's verdicts) with the SHA-256 of its content; one
  that does not verify reads as empty (the verdicts are measured again).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SUMS = ".sha256.json"  # a sealed directory's manifest


def inside(root: Path, relative: str) -> Path | None:
    """root / relative when it resolves inside root (symlinks followed); else None, with a log line."""
    path = root / relative
    try:
        ok = path.resolve().is_relative_to(root.resolve())
    except (OSError, ValueError, RuntimeError):
        ok = False
    if not ok:
        log.warning("refused the path %r read from %s: it leads outside that directory", str(relative)[:200], root)
        return None
    return path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def seal(directory: Path) -> None:
    """Write the manifest of every file in directory (written last: a directory without one is unfinished)."""
    sums = {p.name: _sha256(p) for p in sorted(directory.iterdir()) if p.is_file() and p.name != SUMS}
    tmp = directory / (SUMS + ".tmp")
    tmp.write_text(json.dumps(sums, indent=1))
    os.replace(tmp, directory / SUMS)


def check_seal(directory: Path) -> str | None:
    """None when every file the manifest names is there with its sum (and no other file is); else why not."""
    try:
        sums = json.loads((directory / SUMS).read_text())
    except FileNotFoundError:
        return "has no checksums"
    except (OSError, ValueError, UnicodeDecodeError):
        return "has unreadable checksums"
    if not isinstance(sums, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in sums.items()):
        return "has unreadable checksums"
    present = {p.name for p in directory.iterdir() if p.is_file() and p.name != SUMS}
    if present != set(sums):
        return f"holds other files than it was written with ({', '.join(sorted(present ^ set(sums)))[:200]})"
    bad = [name for name, want in sums.items() if inside(directory, name) is None or _sha256(directory / name) != want]
    return f"has files that do not match their checksums ({', '.join(bad)[:300]})" if bad else None


def sealed_json(obj: Any) -> str:
    body = json.dumps(obj, indent=2, sort_keys=True)
    return json.dumps({"sha256": hashlib.sha256(body.encode()).hexdigest(), "body": body})


def read_sealed_json(path: Path) -> Any:
    """The object `sealed_json` wrote to path; None when the file is missing or does not verify (logged)."""
    try:
        outer = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, UnicodeDecodeError):
        outer = None
    body = outer.get("body") if isinstance(outer, dict) else None
    if not isinstance(body, str) or hashlib.sha256(body.encode()).hexdigest() != outer.get("sha256"):
        log.warning("%s does not match its checksum; it is ignored and measured again", path)
        return None
    return json.loads(body)
