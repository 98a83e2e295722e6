"""How the user ran agentbox, so that a printed fix pastes as is: the README runs `.venv/bin/agentbox`
without activating the environment, where a bare `agentbox` is not on PATH."""

from __future__ import annotations

import shlex
import shutil
import sys
from pathlib import Path


def agentbox_cmd() -> str:
    """`agentbox` when that name runs this same program, else the path the user typed (`.venv/bin/agentbox`)."""
    argv0 = sys.argv[0] if sys.argv else ""
    if Path(argv0).name != "agentbox":
        return "agentbox"  # run as a module or from a test: the plain name reads best
    on_path = shutil.which("agentbox")
    if on_path and Path(on_path).resolve() == Path(argv0).resolve():
        return "agentbox"
    return shlex.quote(argv0)


def pip_cmd() -> str:
    """pip of the interpreter running agentbox: a bare `pip` may install into another Python."""
    return f"{shlex.quote(sys.executable)} -m pip"
