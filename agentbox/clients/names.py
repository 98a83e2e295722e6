"""The one client vocabulary of `setup`, `launch` and everything else that names a coding client: short names
(what users type and what errors list) plus the long forms people also use, accepted everywhere."""

from __future__ import annotations

from enum import Enum


class ClientError(Exception):
    """A user-facing failure (unknown client, no model known, no backup to undo, client not installed, bad config)."""


class Client(str, Enum):
    CLAUDE = "claude"
    CODEX = "codex"
    OPENCODE = "opencode"
    AIDER = "aider"
    ENV = "env"  # setup only: print the environment lines any other OpenAI or Anthropic client reads


AGENTS = (Client.CLAUDE, Client.CODEX, Client.OPENCODE, Client.AIDER)  # the clients `launch` runs
# Package, repository and product names for the same programs (`npm i -g @anthropic-ai/claude-code`,
# `pip install aider-chat`, `npm i -g opencode-ai`, the codex repository's `codex-cli`).
ALIASES = {"claude-code": Client.CLAUDE, "claude_code": Client.CLAUDE, "claudecode": Client.CLAUDE,
           "codex-cli": Client.CODEX, "openai-codex": Client.CODEX, "opencode-ai": Client.OPENCODE,
           "open-code": Client.OPENCODE, "aider-chat": Client.AIDER}


def choices(*, with_env: bool) -> str:
    names = [c.value for c in (*AGENTS, Client.ENV) if with_env or c is not Client.ENV]
    return ", ".join(names)


def parse_client(name: str, *, with_env: bool = True) -> Client:
    """A client from its name or any alias (case-insensitive); ClientError listing the names otherwise."""
    if isinstance(name, Client) and (with_env or name is not Client.ENV):
        return name
    key = str(name).strip().lower()
    found = ALIASES.get(key) or next((c for c in Client if c.value == key), None)
    if found is None or (found is Client.ENV and not with_env):
        what = "setup" if with_env else "launch"
        raise ClientError(f"unknown client {name!r} for {what}; choose from {choices(with_env=with_env)} "
                          "(long forms such as claude-code also work)")
    return found
