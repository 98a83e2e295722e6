"""`agentbox setup` and `agentbox launch`: the actions behind the two commands (the CLI only prints)."""

from __future__ import annotations

import os
import shutil
import sys
from typing import NoReturn

from agentbox.clients import files, sync
from agentbox.clients.names import Client, ClientError, parse_client
from agentbox.clients.targets import Endpoint, config_path, launch_command, plan


def setup_client(name: str, ep: Endpoint, *, dry_run: bool = False, undo: bool = False,
                 force: bool = False) -> list[str]:
    """Apply (or preview, or undo) a client's setup; returns the lines to show the user."""
    client = parse_client(name)
    path = config_path(client)
    if undo and path is not None:  # undo needs no server numbers, only the file
        if dry_run:
            return [files.describe_undo(path)]
        try:
            done = files.undo(path)
        except FileNotFoundError as e:
            raise ClientError(str(e)) from e
        sync.forget(client)  # `serve` keeps no undone setup in step
        return [done]
    try:
        p = plan(client, ep, force=force)
    except ValueError as e:  # includes JSON / TOML decode errors of an existing file
        raise ClientError(str(e)) from e
    if p.path is None:  # export-only clients
        if undo:
            return ["nothing to undo: this client's setup only prints environment lines"]
        return [*p.exports, *([f"# {p.note}"] if p.note else [])]
    if dry_run:
        diff = files.unified_diff(p.path, p.old, p.new)
        return [diff.rstrip("\n") if diff else f"{p.path} is already set up", *p.exports]
    changed, saved = files.write_with_backup(p.path, p.new, private=p.secret)
    sync.remember(client, ep.url)  # `agentbox serve` keeps it in step with what it serves
    if not changed:
        return [f"{p.path} is already set up", *p.exports, *([p.note] if p.note else [])]
    done = f"wrote {p.path} ({f'backup: {saved.name}' if saved else 'new file'}; undo with --undo)"
    return [done, *p.exports, *([p.note] if p.note else [])]


def launch_client(name: str, ep: Endpoint, args: list[str], *, force: bool = False) -> NoReturn:
    """Replace this process with the client, its environment pointed at the server. Writes no file."""
    client = parse_client(name, with_env=False)
    try:
        argv, extra, note = launch_command(client, ep, args, force=force)
    except ValueError as e:
        raise ClientError(str(e)) from e
    exe = shutil.which(argv[0])
    if exe is None:
        raise ClientError(f"`{argv[0]}` is not on PATH; install {client.value} first, or use `agentbox setup`")
    if note:
        print(note, file=sys.stderr, flush=True)
    os.execvpe(exe, argv, {**os.environ, **extra})


__all__ = ["Client", "launch_client", "setup_client"]
