"""What each coding client needs to talk to the local server: files to merge and environments to set.

Planning is pure (a function of the existing file and the endpoint), so `--dry-run`, the real write and
the tests all go through the same code.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentbox.clients import toml_writer
from agentbox.config import ServerConfig, state_dir

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

SETUP_CLIENTS = ("claude-code", "codex", "opencode", "aider", "env")
LAUNCH_CLIENTS = {"claude": "claude", "codex": "codex", "opencode": "opencode"}
PROVIDER_ID = "agentbox"
DEFAULT_CONTEXT = 32768
NO_KEY = "agentbox"  # clients insist on a non-empty key; the server ignores it when auth is off


class ClientError(Exception):
    """A user-facing failure (no model known, no backup to undo, client not installed, bad config)."""


@dataclass(frozen=True)
class Endpoint:
    url: str  # the server root, e.g. http://127.0.0.1:8000 (no /v1)
    model: str
    api_key: str = NO_KEY
    context: int = DEFAULT_CONTEXT

    @property
    def openai_url(self) -> str:
        return self.url + "/v1"


@dataclass
class Plan:
    """A file to write (path, old text, new text) and/or lines to print."""

    path: Path | None = None
    old: str = ""
    new: str = ""
    exports: list[str] = field(default_factory=list)
    note: str = ""


def server_state() -> dict[str, Any]:
    """The running server's state file (host, port, pid, model), or {} when none is recorded."""
    path = state_dir() / "server.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def resolve_endpoint(url: str | None = None, model: str | None = None, api_key: str | None = None,
                     context: int | None = None, *, require_model: bool = True) -> Endpoint:
    """Flags win; then the running server's state file; then config defaults."""
    state = server_state()
    if url is None:
        defaults = ServerConfig()
        host = state.get("host") or defaults.host
        host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        url = f"http://{host}:{state.get('port') or defaults.port}"
    url = url.rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    model = model or state.get("model")
    if not model and require_model:
        raise ClientError("no --model given and no running server to ask; start one (agentbox serve) or pass --model")
    ctx = context or state.get("max_model_len") or state.get("context") or DEFAULT_CONTEXT
    return Endpoint(url=url, model=str(model or ""), api_key=api_key or state.get("api_key") or NO_KEY, context=int(ctx))


def home() -> Path:
    return Path(os.path.expanduser("~"))


def claude_env(ep: Endpoint) -> dict[str, str]:
    return {
        "ANTHROPIC_BASE_URL": ep.url,  # Claude Code appends /v1/messages itself
        "ANTHROPIC_AUTH_TOKEN": ep.api_key,
        "ANTHROPIC_MODEL": ep.model,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": ep.model,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": ep.model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": ep.model,
        # The attribution header changes per request and would break the cached prefix.
        "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
    }


def openai_env(ep: Endpoint) -> dict[str, str]:
    return {"OPENAI_BASE_URL": ep.openai_url, "OPENAI_API_BASE": ep.openai_url, "OPENAI_API_KEY": ep.api_key}


def codex_provider(ep: Endpoint) -> dict[str, Any]:
    return {"name": "agentbox (local)", "base_url": ep.openai_url, "wire_api": "responses"}


def opencode_provider(ep: Endpoint) -> dict[str, Any]:
    return {
        "npm": "@ai-sdk/openai-compatible",
        "name": "agentbox (local)",
        "options": {"baseURL": ep.openai_url, "apiKey": ep.api_key},
        "models": {ep.model: {"name": ep.model, "limit": {"context": ep.context, "output": min(ep.context, 32768)}}},
    }


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def _load_json(path: Path, text: str) -> dict[str, Any]:
    if not text.strip():
        return {}
    data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


def plan(client: str, ep: Endpoint) -> Plan:
    if client == "claude-code":
        path = home() / ".claude" / "settings.json"
        old = _read(path)
        data = _load_json(path, old)
        data["env"] = {**(data.get("env") or {}), **claude_env(ep)}
        return Plan(path, old, json.dumps(data, indent=2, ensure_ascii=False) + "\n", note="then run: claude")
    if client == "codex":
        path = home() / ".codex" / "config.toml"
        old = _read(path)
        data = tomllib.loads(old) if old.strip() else {}
        data["model"] = ep.model
        data["model_provider"] = PROVIDER_ID
        providers = data.setdefault("model_providers", {})
        providers[PROVIDER_ID] = {**providers.get(PROVIDER_ID, {}), **codex_provider(ep)}
        return Plan(path, old, toml_writer.dumps(data), note="then run: codex")
    if client == "opencode":
        path = home() / ".config" / "opencode" / "opencode.json"
        old = _read(path)
        data = _load_json(path, old)
        data.setdefault("$schema", "https://opencode.ai/config.json")
        providers = data.setdefault("provider", {})
        providers[PROVIDER_ID] = opencode_provider(ep)
        data["model"] = f"{PROVIDER_ID}/{ep.model}"
        return Plan(path, old, json.dumps(data, indent=2, ensure_ascii=False) + "\n", note="then run: opencode")
    if client == "aider":
        env = {"OPENAI_API_BASE": ep.openai_url, "OPENAI_API_KEY": ep.api_key}
        return Plan(exports=_exports(env), note=f"then run: aider --model openai/{ep.model}")
    if client == "env":
        return Plan(exports=_exports({**openai_env(ep), **claude_env(ep)}))
    raise ValueError(f"unknown client {client!r}; choose from {', '.join(SETUP_CLIENTS)}")


def _exports(env: dict[str, str]) -> list[str]:
    import shlex

    return [f"export {k}={shlex.quote(v)}" for k, v in env.items()]


def launch_command(client: str, ep: Endpoint, args: list[str]) -> tuple[list[str], dict[str, str]]:
    """argv and the environment additions that point a client at the server without touching files."""
    if client == "claude":
        return ["claude", *args], claude_env(ep)
    if client == "codex":
        provider = "{" + ", ".join(f"{k}={json.dumps(v)}" for k, v in codex_provider(ep).items()) + "}"
        argv = ["codex", "-c", f"model_providers.{PROVIDER_ID}={provider}", "-c", f"model_provider={PROVIDER_ID}",
                "-m", ep.model, *args]
        return argv, {"OPENAI_API_KEY": ep.api_key}
    if client == "opencode":
        config = {"provider": {PROVIDER_ID: opencode_provider(ep)}, "model": f"{PROVIDER_ID}/{ep.model}"}
        return ["opencode", *args], {"OPENCODE_CONFIG_CONTENT": json.dumps(config)}
    raise ValueError(f"unknown client {client!r}; choose from {', '.join(LAUNCH_CLIENTS)}")
