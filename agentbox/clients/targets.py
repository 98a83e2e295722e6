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
from agentbox.clients.routing import routing_headers
from agentbox.config import ServerConfig, state_dir

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

SETUP_CLIENTS = ("claude-code", "codex", "opencode", "aider", "env")
LAUNCH_CLIENTS = {"claude": "claude", "codex": "codex", "opencode": "opencode", "aider": "aider"}
PROVIDER_ID = "agentbox"
NO_KEY = "agentbox"  # clients insist on a non-empty key; the server ignores it when auth is off
KEY_ENV = "AGENTBOX_API_KEY"  # where Codex's provider reads the key (`env_key`), and `serve --api-key`'s env
OUTPUT_SHARE = 4  # the output limit told to clients leaves at least 3/4 of the context for the prompt
# Each client's own first prompt (system prompt + tool definitions) in tokens, measured by the real-client
# tests (tests/test_real_clients.py, SmolLM2's tokenizer, a one-line task) with the pinned versions: Claude
# Code 2.1.332 about 24.8k, Codex 0.171.0 about 6.5k, aider 0.86.2 about 0.7k. launch refuses a context
# that cannot hold it plus a minimal answer. opencode is not measured, so not checked.
CLIENT_PROMPT_TOKENS = {"claude": 24_000, "codex": 6_500, "aider": 700}
MIN_ANSWER_TOKENS = 1024


class ClientError(Exception):
    """A user-facing failure (no model known, no backup to undo, client not installed, bad config)."""


@dataclass(frozen=True)
class Endpoint:
    url: str  # the server root, e.g. http://127.0.0.1:8000 (no /v1)
    model: str
    api_key: str = NO_KEY
    context: int | None = None  # the served context window (None: no server was asked and no --context)
    max_output: int | None = None  # the output limit told to clients
    has_key: bool = False  # the server requires a key

    @property
    def openai_url(self) -> str:
        return self.url + "/v1"

    def limits(self) -> tuple[int, int]:
        """(context, output limit), or ClientError when neither the server nor a flag gave the context."""
        if self.context is None:
            raise ClientError("no running server to read the context window from; start one (agentbox serve) "
                              "or pass --context")
        out = self.max_output or self.context // OUTPUT_SHARE
        return self.context, max(1, min(out, self.context // OUTPUT_SHARE))


@dataclass
class Plan:
    """A file to write (path, old text, new text) and/or lines to print."""

    path: Path | None = None
    old: str = ""
    new: str = ""
    exports: list[str] = field(default_factory=list)
    note: str = ""


def server_state() -> dict[str, Any]:
    """The running server's state file (host, port, pid, model, api_key), or {} when none is recorded."""
    path = state_dir() / "server.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def served_model(url: str, api_key: str) -> dict[str, Any] | None:
    """The server's own numbers from `GET /v1/models` (id, max_model_len, max_output_tokens), or None."""
    import httpx

    try:
        r = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {api_key}"}, timeout=5.0)
    except httpx.HTTPError:
        return None
    if r.status_code == 401:
        raise ClientError(f"the server at {url} requires an API key: pass --api-key or set {KEY_ENV}")
    try:
        data = r.json()["data"][0] if r.status_code == 200 else None
    except (ValueError, KeyError, IndexError, TypeError):
        return None
    return data if isinstance(data, dict) else None


def resolve_endpoint(url: str | None = None, model: str | None = None, api_key: str | None = None,
                     context: int | None = None, max_output: int | None = None, *,
                     require_model: bool = True) -> Endpoint:
    """Flags win; then what the running server reports; then its state file; then config defaults."""
    state = server_state()
    if url is None:
        defaults = ServerConfig()
        host = state.get("host") or defaults.host
        host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        url = f"http://{host}:{state.get('port') or defaults.port}"
    url = url.rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    key = api_key or state.get("api_key") or None
    served = served_model(url, key or NO_KEY)
    served = served or {}
    model = model or served.get("id") or state.get("model")
    if not model and require_model:
        raise ClientError("no --model given and no running server to ask; start one (agentbox serve) or pass --model")
    ctx = context or served.get("max_model_len") or state.get("max_model_len")
    out = max_output or served.get("max_output_tokens")
    return Endpoint(url=url, model=str(model or ""), api_key=key or NO_KEY, context=int(ctx) if ctx else None,
                    max_output=int(out) if out else None, has_key=key is not None)


def home() -> Path:
    return Path(os.path.expanduser("~"))


def claude_env(ep: Endpoint) -> dict[str, str]:
    env = {
        "ANTHROPIC_BASE_URL": ep.url,  # Claude Code appends /v1/messages itself
        "ANTHROPIC_AUTH_TOKEN": ep.api_key,
        "ANTHROPIC_MODEL": ep.model,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": ep.model,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": ep.model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": ep.model,
        # The attribution header changes per request and would break the cached prefix.
        "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",  # no telemetry or update checks to reach
    }
    if ep.context is not None:
        ctx, out = ep.limits()
        # Claude Code 2.1 assumes a 200k window for an unknown model; these two (read from its binary,
        # not guessed) make it compact at the served window and ask for no more output than it allows.
        env["CLAUDE_CODE_AUTO_COMPACT_WINDOW"] = str(ctx)
        env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = str(out)
    return env


def openai_env(ep: Endpoint) -> dict[str, str]:
    return {"OPENAI_BASE_URL": ep.openai_url, "OPENAI_API_BASE": ep.openai_url, "OPENAI_API_KEY": ep.api_key}


def codex_provider(ep: Endpoint, with_key: bool, per_launch: bool = False) -> dict[str, Any]:
    provider: dict[str, Any] = {"name": "agentbox (local)", "base_url": ep.openai_url, "wire_api": "responses",
                                "http_headers": routing_headers(per_launch)}  # a fleet's routing key
    if with_key:
        provider["env_key"] = KEY_ENV  # Codex sends $AGENTBOX_API_KEY as the bearer token
    return provider


def codex_limits(ep: Endpoint) -> dict[str, int]:
    """Codex 0.171's config keys (it has no output-limit key; the server's default budget applies)."""
    ctx, out = ep.limits()
    return {"model_context_window": ctx, "model_auto_compact_token_limit": ctx - out}


def opencode_provider(ep: Endpoint, per_launch: bool = False) -> dict[str, Any]:
    ctx, out = ep.limits()
    return {
        "npm": "@ai-sdk/openai-compatible",
        "name": "agentbox (local)",
        "options": {"baseURL": ep.openai_url, "apiKey": ep.api_key, "headers": routing_headers(per_launch)},
        "models": {ep.model: {"name": ep.model, "limit": {"context": ctx, "output": out}}},
    }


def aider_metadata(ep: Endpoint) -> dict[str, Any]:
    """litellm model metadata (aider's --model-metadata-file): the served window instead of a guess."""
    ctx, out = ep.limits()
    return {f"openai/{ep.model}": {"max_input_tokens": ctx - out, "max_output_tokens": out, "max_tokens": out,
                                   "input_cost_per_token": 0.0, "output_cost_per_token": 0.0,
                                   "litellm_provider": "openai", "mode": "chat"}}


def check_fits(client: str, ep: Endpoint) -> None:
    """Refuse a client whose own prompt cannot fit the served context, with the numbers and a way out."""
    need = CLIENT_PROMPT_TOKENS.get(client)
    if need is None or ep.context is None or ep.context >= need + MIN_ANSWER_TOKENS:
        return
    from agentbox.hub.profiles import load_profiles

    fits = sorted((p for p in load_profiles() if p.context_length >= need + MIN_ANSWER_TOKENS), key=lambda p: p.params)
    hint = f"; serve a model with a longer context, e.g. agentbox serve --model {fits[0].name} " \
           f"({fits[0].context_length} tokens)" if fits else ""
    raise ClientError(f"{client}'s own prompt (system prompt and tools) is about {need} tokens, but this server's "
                      f"context is {ep.context} tokens (at least {need + MIN_ANSWER_TOKENS} needed){hint}; --force launches anyway")


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def _load_json(path: Path, text: str) -> dict[str, Any]:
    if not text.strip():
        return {}
    data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


CONFIG_FILES = {"claude-code": ".claude/settings.json", "codex": ".codex/config.toml",
                "opencode": ".config/opencode/opencode.json", "aider": ".aider.model.metadata.json"}


def config_path(client: str) -> Path | None:
    """The file `setup` writes for a client (None for export-only ones)."""
    rel = CONFIG_FILES.get(client)
    return home() / rel if rel else None


def plan(client: str, ep: Endpoint) -> Plan:
    if client == "claude-code":
        path = config_path(client)
        assert path is not None
        old = _read(path)
        data = _load_json(path, old)
        data["env"] = {**(data.get("env") or {}), **claude_env(ep)}
        return Plan(path, old, json.dumps(data, indent=2, ensure_ascii=False) + "\n", note="then run: claude")
    if client == "codex":
        path = config_path(client)
        assert path is not None
        old = _read(path)
        data = tomllib.loads(old) if old.strip() else {}
        data["model"] = ep.model
        data["model_provider"] = PROVIDER_ID
        data.update(codex_limits(ep))
        providers = data.setdefault("model_providers", {})
        providers[PROVIDER_ID] = {**providers.get(PROVIDER_ID, {}), **codex_provider(ep, ep.has_key)}
        note = f"then run: export {KEY_ENV}=...; codex" if ep.has_key else "then run: codex"
        return Plan(path, old, toml_writer.dumps(data), note=note)
    if client == "opencode":
        path = config_path(client)
        assert path is not None
        old = _read(path)
        data = _load_json(path, old)
        data.setdefault("$schema", "https://opencode.ai/config.json")
        providers = data.setdefault("provider", {})
        providers[PROVIDER_ID] = opencode_provider(ep)
        data["model"] = f"{PROVIDER_ID}/{ep.model}"
        return Plan(path, old, json.dumps(data, indent=2, ensure_ascii=False) + "\n", note="then run: opencode")
    if client == "aider":
        env = {"OPENAI_API_BASE": ep.openai_url, "OPENAI_API_KEY": ep.api_key}
        path = config_path(client)
        assert path is not None
        old = _read(path)
        data = _load_json(path, old)
        data.update(aider_metadata(ep))
        return Plan(path, old, json.dumps(data, indent=2) + "\n", exports=_exports(env),
                    note=f"then run: aider --model openai/{ep.model}")
    if client == "env":
        return Plan(exports=_exports({**openai_env(ep), **claude_env(ep)}))
    raise ValueError(f"unknown client {client!r}; choose from {', '.join(SETUP_CLIENTS)}")


def _exports(env: dict[str, str]) -> list[str]:
    import shlex

    return [f"export {k}={shlex.quote(v)}" for k, v in env.items()]


def launch_command(client: str, ep: Endpoint, args: list[str]) -> tuple[list[str], dict[str, str]]:
    """argv and the environment additions that point a client at the server without touching its files."""
    if client == "claude":
        return ["claude", *args], claude_env(ep)
    if client == "codex":
        provider = _inline_toml(codex_provider(ep, True, per_launch=True))
        limits = [a for k, v in codex_limits(ep).items() for a in ("-c", f"{k}={v}")]
        argv = ["codex", "-c", f"model_providers.{PROVIDER_ID}={provider}", "-c", f"model_provider={PROVIDER_ID}",
                *limits, "-m", ep.model, *args]
        return argv, {KEY_ENV: ep.api_key}
    if client == "opencode":
        config = {"provider": {PROVIDER_ID: opencode_provider(ep, per_launch=True)}, "model": f"{PROVIDER_ID}/{ep.model}"}
        return ["opencode", *args], {"OPENCODE_CONFIG_CONTENT": json.dumps(config)}
    if client == "aider":
        # aider reads model limits only from a file: ours lives in agentbox's state dir, not the user's.
        meta = state_dir() / "aider.model.metadata.json"
        meta.write_text(json.dumps(aider_metadata(ep), indent=2))
        # the fleet's routing key as litellm extra_headers (a settings file is YAML; JSON is YAML)
        settings = state_dir() / "aider.model.settings.yml"
        settings.write_text(json.dumps([{"name": f"openai/{ep.model}",
                                         "extra_params": {"extra_headers": routing_headers(True)}}]))
        argv = ["aider", "--model", f"openai/{ep.model}", "--model-metadata-file", str(meta),
                "--model-settings-file", str(settings),
                "--no-show-model-warnings", "--no-check-update", "--analytics-disable", *args]
        return argv, {"OPENAI_API_BASE": ep.openai_url, "OPENAI_API_KEY": ep.api_key}
    raise ValueError(f"unknown client {client!r}; choose from {', '.join(LAUNCH_CLIENTS)}")


def _inline_toml(table: dict[str, Any]) -> str:
    """A TOML inline table for `codex -c` (values JSON-quoted, which TOML reads; nested tables inline too)."""
    items = (f"{json.dumps(k) if not k.isidentifier() else k}="
             f"{_inline_toml(v) if isinstance(v, dict) else json.dumps(v)}" for k, v in table.items())
    return "{" + ", ".join(items) + "}"
