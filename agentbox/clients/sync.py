"""What `agentbox setup` wrote stays in step with the server: setup remembers each client it set up (its file and
the server's URL, in the state dir), and `agentbox serve` re-applies those setups to the server it starts, so a
client follows the served model's context without a second setup (the model name it sends is the stable alias,
config.STABLE_MODEL_ALIAS, which every model answers to). A file is updated only while it still points at that
server (the user may have pointed the client elsewhere since), backed up first as setup does."""

from __future__ import annotations

import json
from pathlib import Path

from agentbox.clients import files
from agentbox.clients.names import Client, ClientError
from agentbox.clients.targets import PROVIDER_ID, Endpoint, config_path, plan, tomllib
from agentbox.config import state_dir


def _ledger() -> Path:
    return state_dir() / "setup-clients.json"


def _records() -> dict[str, str]:
    """client name -> the server root it was set up for."""
    try:
        data = json.loads(_ledger().read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


def _save(records: dict[str, str]) -> None:
    _ledger().write_text(json.dumps(records, indent=1))


def remember(client: Client, url: str) -> None:
    _save({**_records(), client.value: url})


def forget(client: Client) -> None:
    records = _records()
    if records.pop(client.value, None) is not None:
        _save(records)


def points_here(client: Client, text: str, ep: Endpoint) -> bool:
    """Whether the client's file, as it is now, still sends this client to `ep`'s server."""
    try:
        if client is Client.CODEX:
            data = tomllib.loads(text)
            provider = (data.get("model_providers") or {}).get(PROVIDER_ID) or {}
            return data.get("model_provider") == PROVIDER_ID and provider.get("base_url") == ep.openai_url
        data = json.loads(text)
    except ValueError:  # a file the user broke: not ours to rewrite
        return False
    if client is Client.CLAUDE:
        return (data.get("env") or {}).get("ANTHROPIC_BASE_URL") == ep.url
    if client is Client.OPENCODE:
        options = ((data.get("provider") or {}).get(PROVIDER_ID) or {}).get("options") or {}
        return options.get("baseURL") == ep.openai_url and str(data.get("model", "")).startswith(f"{PROVIDER_ID}/")
    return f"openai/{ep.model}" in data  # aider: its metadata file has no URL; our model's entry is there


def resync(ep: Endpoint) -> list[str]:
    """Re-applies every remembered setup for `ep`'s server to its numbers now; the lines to show (none when
    nothing was set up for it or nothing changed)."""
    lines = []
    for name, url in sorted(_records().items()):
        client = Client(name)
        path = config_path(client)
        if url != ep.url or path is None or not path.exists():
            continue
        old = path.read_text()
        if not points_here(client, old, ep):
            lines.append(f"{name}: {path} points elsewhere now; left as it is")
            continue
        try:
            new = plan(client, ep)
        except (ClientError, ValueError) as exc:
            lines.append(f"{name}: left as it is: {exc}")
            continue
        changed, saved = files.write_with_backup(path, new.new, private=new.secret)
        if changed:
            lines.append(f"{name}: updated {path} for context {ep.context:,} (backup: {saved.name if saved else '-'})")
    return lines
