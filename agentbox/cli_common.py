"""What every `agentbox` command module shares. It imports nothing of cli.py, so cli.py can import the
command modules (cli_workstation, cli_bench) without a cycle, also when it runs as `python -m agentbox.cli`."""

from __future__ import annotations

from typing import NoReturn

import typer


def fail(message: str, code: int = 1) -> NoReturn:
    """Print a red `error:` line on stderr and exit: how every command reports a user error."""
    typer.secho(f"error: {message}", fg="red", err=True)
    raise typer.Exit(code)
