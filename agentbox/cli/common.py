"""What every `agentbox` command module shares: owns `fail` (a user error as one red line and an exit code),
the --debug switch and the entry point that keeps tracebacks from users (`run_cli`). It imports nothing of
cli/main.py, so cli/main.py can import the command modules (workstation.py, bench.py, fleet.py) without a
cycle, also when it runs as `python -m agentbox.cli.main`."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import NoReturn

import typer

DEBUG_ENV = "AGENTBOX_DEBUG"


def fail(message: str, code: int = 1) -> NoReturn:
    """Print a red `error:` line on stderr and exit: how every command reports a user error."""
    typer.secho(f"error: {message}", fg="red", err=True)
    raise typer.Exit(code)


def debug_enabled() -> bool:
    return os.environ.get(DEBUG_ENV, "").lower() not in ("", "0", "false", "no", "off")


def run_cli(app: Callable[..., object]) -> None:
    """The `agentbox` entry point: the app with tracebacks for `--debug` (anywhere before a launched
    client's own arguments) or AGENTBOX_DEBUG=1 only. Otherwise an unexpected exception is one error line
    naming it and how to see the traceback: a user's mistake must never end in a traceback."""
    argv = sys.argv[1:]
    if "--debug" in argv[: argv.index("launch") if "launch" in argv else len(argv)]:
        argv.remove("--debug")
        os.environ[DEBUG_ENV] = "1"
    if debug_enabled():
        app(args=argv)
        return
    try:
        app(args=argv)
    except KeyboardInterrupt:  # Ctrl-C between a command's own handlers: nothing to explain
        sys.exit(130)
    except Exception as exc:
        typer.secho(f"error: {type(exc).__name__}: {exc}", fg="red", err=True)
        typer.echo(f"  for the traceback run it again with --debug (or {DEBUG_ENV}=1)", err=True)
        sys.exit(1)
