"""The `agentbox` command. Each command is a thin function over the modules; defaults come from config.py."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="agentbox",
    help="Serve a language model to coding agents on your own GPUs, with each session's cache kept resident.",
    no_args_is_help=True,
    add_completion=False,
)

# ---- serving: serve / status / stop / logs (engine + daemon) ----

# ---- workstation: plan / pull / models / doctor (hw + hub) ----

# ---- clients: setup / launch / check (clients + chat) ----

# ---- bench ----


def main() -> None:
    app()


if __name__ == "__main__":
    main()
