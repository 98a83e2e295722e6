"""`agentbox setup` and `agentbox launch`: the actions behind the two commands (the CLI only prints)."""

from __future__ import annotations

import os
import shutil
from typing import NoReturn

from agentbox.clients import files
from agentbox.clients.targets import ClientError, Endpoint, check_fits, config_path, launch_command, plan


def setup_client(client: str, ep: Endpoint, *, dry_run: bool = False, undo: bool = False) -> list[str]:
    """Apply (or preview, or undo) a client's setup; returns the lines to show the user."""
    path = config_path(client)
    if undo and path is not None:  # undo needs no server numbers, only the file
        if dry_run:
            found = files.backups(path)
            return [f"would restore {found[-1]}" if found else f"no agentbox backup of {path}"]
        try:
            restored = files.undo(path)
        except FileNotFoundError as e:
            raise ClientError(str(e)) from e
        return [f"restored {path} from {restored.name}"]
    try:
        p = plan(client, ep)
    except ValueError as e:  # includes JSON / TOML decode errors of an existing file
        raise ClientError(str(e)) from e
    if p.path is None:  # export-only clients
        if undo:
            return ["nothing to undo: this client's setup only prints environment lines"]
        return [*p.exports, *([f"# {p.note}"] if p.note else [])]
    if dry_run:
        diff = files.unified_diff(p.path, p.old, p.new)
        return [diff.rstrip("\n") if diff else f"{p.path} is already set up", *p.exports]
    saved = files.write_with_backup(p.path, p.new)
    if saved is None:
        return [f"{p.path} is already set up", *p.exports]
    return [f"wrote {p.path} (backup: {saved.name}; undo with --undo)", *p.exports, *([p.note] if p.note else [])]


def launch_client(client: str, ep: Endpoint, args: list[str], *, force: bool = False) -> NoReturn:
    """Replace this process with the client, its environment pointed at the server. Writes no file."""
    if not force:
        check_fits(client, ep)
    try:
        argv, extra = launch_command(client, ep, args)
    except ValueError as e:
        raise ClientError(str(e)) from e
    exe = shutil.which(argv[0])
    if exe is None:
        raise ClientError(f"`{argv[0]}` is not on PATH; install {client} first, or use `agentbox setup`")
    os.execvpe(exe, argv, {**os.environ, **extra})
