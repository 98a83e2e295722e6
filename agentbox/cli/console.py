"""The commands' console, owning how wide their output is: the terminal's width on a terminal, $COLUMNS when
it is set, and no width at all into a pipe or a file (`agentbox plan | less`, `agentbox models > list`),
where a line cut at 80 columns splits the paths and commands a user copies."""

from __future__ import annotations

import os
import shutil
import sys
from typing import TextIO

from rich.console import Console

# Rich needs a number; a pipe's lines end where their text does, never near this.
UNWRAPPED = 100_000


def output_width(stream: TextIO | None = None) -> int | None:
    """Columns to fit the output to, or None for unwrapped."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    stream = stream or sys.stdout
    if stream.isatty():
        return shutil.get_terminal_size().columns
    return None


def console(stderr: bool = False) -> Console:
    """A rich Console for a command's output: fitted to the terminal, or unwrapped when piped."""
    width = output_width(sys.stderr if stderr else sys.stdout)
    if width is None:
        return Console(stderr=stderr, width=UNWRAPPED, soft_wrap=True)
    return Console(stderr=stderr, width=width)
