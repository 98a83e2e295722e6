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
from agentbox.clients.fit import Fit, fit, forced
from agentbox.clients.names import AGENTS, Client, ClientError, choices
from agentbox.clients.routing import routing_headers
from agentbox.config import STABLE_MODEL_ALIAS, ServerConfig, state_dir

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

PROVIDER_ID = "agentbox"
NO_KEY = "agentbox"  # clients insist on a non-empty key; the server ignores it when auth is off
KEY_ENV = "AGENTBOX_API_KEY"  # where Codex's provider reads the key (`env_key`), and `serve --api-key`'s env
OUTPUT_SHARE = 4  # the output limit told to clients leaves at least 3/4 of the context for the prompt
# opencode's start-up traffic that a local server does not need: the models.dev catalogue (an environment
# switch only: setup prints it), the update check and session sharing (also keys of the config setup writes).
# What setup once wrote into opencode.json on a small context (opencode's compaction off, a switch for all of its
# providers) before clients/fit.py adapted the output limit instead: removed where agentbox's provider entry
# shows that agentbox set the file up.
LEGACY_COMPACTION_OFF = {"auto": False}
OPENCODE_QUIET_ENV = {"OPENCODE_DISABLE_MODELS_FETCH": "1", "OPENCODE_DISABLE_AUTOUPDATE": "1",
                      "OPENCODE_DISABLE_SHARE": "1"}


@dataclass(frozen=True)
class Endpoint:
    url: str  # the server root, e.g. http://127.0.0.1:8000 (no /v1)
    model: str  # the name clients send: config.STABLE_MODEL_ALIAS where the server answers to it
    api_key: str = NO_KEY
    context: int | None = None  # the served context window (None: no server was asked and no --context)
    max_output: int | None = None  # the output limit told to clients
    has_key: bool = False  # the server requires a key
    served: str = ""  # the model's own name (what it is, for a client's display); "" when no server was asked

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
    secret: bool = False  # the new text holds a real API key: the file is written readable by its owner only


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
    # The stable alias, so the client keeps working when another model is served; the model's own name where
    # the server does not answer to it (not an agentbox server, or an older one).
    stable = STABLE_MODEL_ALIAS if STABLE_MODEL_ALIAS in (served.get("aliases") or ()) else None
    model = model or stable or served.get("id") or state.get("model")
    if not model and require_model:
        raise ClientError("no --model given and no running server to ask; start one (agentbox serve) or pass --model")
    ctx = context or served.get("max_model_len") or state.get("max_model_len")
    out = max_output or served.get("max_output_tokens")
    return Endpoint(url=url, model=str(model or ""), api_key=key or NO_KEY, context=int(ctx) if ctx else None,
                    max_output=int(out) if out else None, has_key=key is not None, served=str(served.get("id") or ""))


def home() -> Path:
    return Path(os.path.expanduser("~"))


def client_fit(client: Client, ep: Endpoint, *, force: bool = False) -> Fit | None:
    """The limits to tell `client` (None when no context is known); ClientError when its own prompt cannot fit
    the served context, unless forced."""
    if ep.context is None:
        return None
    ctx, out = ep.limits()
    try:
        return fit(client, ctx, out)
    except ClientError:
        if not force:
            raise
        return forced(client, ctx, out)


def claude_env(ep: Endpoint, limits: Fit | None) -> dict[str, str]:
    env = {
        "ANTHROPIC_BASE_URL": ep.url,  # Claude Code appends /v1/messages itself
        "ANTHROPIC_AUTH_TOKEN": ep.api_key,
        "ANTHROPIC_MODEL": ep.model,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": ep.model,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": ep.model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": ep.model,
        # The attribution header changes per request and would break the cached prefix.
        "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
        # No telemetry, error reporting, update checks or feedback command (Claude Code's one switch for all four).
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }
    if limits is not None:
        # Claude Code 2.1 assumes a 200k window for an unknown model; these two (read from its binary,
        # not guessed) make it compact at the served window and ask for no more output than it allows.
        env["CLAUDE_CODE_AUTO_COMPACT_WINDOW"] = str(limits.context)
        env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = str(limits.output)
    return env


def openai_env(ep: Endpoint) -> dict[str, str]:
    return {"OPENAI_BASE_URL": ep.openai_url, "OPENAI_API_BASE": ep.openai_url, "OPENAI_API_KEY": ep.api_key}


def codex_provider(ep: Endpoint, with_key: bool, per_launch: bool = False) -> dict[str, Any]:
    provider: dict[str, Any] = {"name": "agentbox (local)", "base_url": ep.openai_url, "wire_api": "responses",
                                "http_headers": routing_headers(per_launch)}  # a fleet's routing key
    if with_key:
        provider["env_key"] = KEY_ENV  # Codex sends $AGENTBOX_API_KEY as the bearer token
    return provider


def codex_settings(limits: Fit) -> dict[str, Any]:
    """Codex 0.171's config keys, dotted (it has no output-limit key; the server's default budget applies, and
    the compaction point leaves the output limit clients/fit.py chose)."""
    return {"model_context_window": limits.context, "model_auto_compact_token_limit": limits.context - limits.output,
            "check_for_update_on_startup": False, "analytics.enabled": False}


def opencode_model(ep: Endpoint, limits: Fit) -> dict[str, Any]:
    name = f"{ep.served} (agentbox)" if ep.served and ep.served != ep.model else ep.model
    return {"name": name, "limit": {"context": limits.context, "output": limits.output}}


def opencode_key(ep: Endpoint) -> str:
    """What opencode's provider reads as its key: never a real key in a file, but opencode's `{env:VAR}`."""
    return f"{{env:{KEY_ENV}}}" if ep.has_key else NO_KEY


def opencode_config(ep: Endpoint, limits: Fit, old: dict[str, Any] | None = None,
                    per_launch: bool = False) -> dict[str, Any]:
    """opencode's config merged into `old`: the provider entry keeps the models it had; no update check and no
    sharing. Nothing global beyond that: the limits live on agentbox's model entry."""
    data = dict(old or {})
    data.setdefault("$schema", "https://opencode.ai/config.json")
    providers = data.setdefault("provider", {})
    entry = dict(providers.get(PROVIDER_ID) or {})
    providers[PROVIDER_ID] = {**entry, "npm": "@ai-sdk/openai-compatible", "name": "agentbox (local)",
                              "options": {**(entry.get("options") or {}), "baseURL": ep.openai_url,
                                          "apiKey": opencode_key(ep), "headers": routing_headers(per_launch)},
                              "models": {**(entry.get("models") or {}), ep.model: opencode_model(ep, limits)}}
    data["model"] = f"{PROVIDER_ID}/{ep.model}"
    data["autoupdate"] = False
    data["share"] = "disabled"
    if entry and data.get("compaction") == LEGACY_COMPACTION_OFF:
        del data["compaction"]  # an earlier agentbox setup's: it turned compaction off for every provider
    return data


def aider_metadata(ep: Endpoint, limits: Fit) -> dict[str, Any]:
    """litellm model metadata (aider's --model-metadata-file): the served window instead of a guess."""
    ctx, out = limits.context, limits.output
    return {f"openai/{ep.model}": {"max_input_tokens": ctx - out, "max_output_tokens": out, "max_tokens": out,
                                   "input_cost_per_token": 0.0, "output_cost_per_token": 0.0,
                                   "litellm_provider": "openai", "mode": "chat"}}


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def _load_json(path: Path, text: str) -> dict[str, Any]:
    if not text.strip():
        return {}
    data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


def _set_dotted(data: dict[str, Any], dotted: dict[str, Any]) -> None:
    for key, value in dotted.items():
        *parents, leaf = key.split(".")
        node = data
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value


CONFIG_FILES = {Client.CLAUDE: ".claude/settings.json", Client.CODEX: ".codex/config.toml",
                Client.OPENCODE: ".config/opencode/opencode.json", Client.AIDER: ".aider.model.metadata.json"}


def config_path(client: Client) -> Path | None:
    """The file `setup` writes for a client (None for export-only ones)."""
    rel = CONFIG_FILES.get(client)
    return home() / rel if rel else None


def _required(limits: Fit | None, ep: Endpoint) -> Fit:
    if limits is None:
        ep.limits()  # raises the ClientError that asks for --context
    assert limits is not None
    return limits


def plan(client: Client, ep: Endpoint, *, force: bool = False) -> Plan:
    if client is Client.ENV:  # lines for any client: the served limits as they are, nothing adapted
        return Plan(exports=_exports({**openai_env(ep), **claude_env(ep, Fit(*ep.limits()) if ep.context else None)}))
    limits = client_fit(client, ep, force=force)
    notes = [limits.note] if limits is not None and limits.note else []
    path = config_path(client)
    old = _read(path) if path is not None else ""
    if client is Client.CLAUDE:
        assert path is not None
        data = _load_json(path, old)
        data["env"] = {**(data.get("env") or {}), **claude_env(ep, limits)}
        # settings.json has no environment indirection: a real key is written, so only the owner may read it.
        return Plan(path, old, json.dumps(data, indent=2, ensure_ascii=False) + "\n", secret=ep.has_key,
                    note="\n".join([*notes, "then run: claude"]))
    if client is Client.CODEX:
        assert path is not None
        data = tomllib.loads(old) if old.strip() else {}
        data["model"] = ep.model
        data["model_provider"] = PROVIDER_ID
        _set_dotted(data, codex_settings(_required(limits, ep)))
        providers = data.setdefault("model_providers", {})
        providers[PROVIDER_ID] = {**providers.get(PROVIDER_ID, {}), **codex_provider(ep, ep.has_key)}
        run = f"then run: export {KEY_ENV}=...; codex" if ep.has_key else "then run: codex"
        return Plan(path, old, toml_writer.dumps(data), note="\n".join([*notes, run]))
    if client is Client.OPENCODE:
        assert path is not None
        data = opencode_config(ep, _required(limits, ep), _load_json(path, old))
        quiet = _exports({k: v for k, v in OPENCODE_QUIET_ENV.items() if k == "OPENCODE_DISABLE_MODELS_FETCH"})
        run = f"then run: export {KEY_ENV}=...; opencode" if ep.has_key else "then run: opencode"
        return Plan(path, old, json.dumps(data, indent=2, ensure_ascii=False) + "\n", exports=quiet,
                    note="\n".join([*notes, run]))
    if client is Client.AIDER:
        assert path is not None
        data = _load_json(path, old)
        data.update(aider_metadata(ep, _required(limits, ep)))
        env = {"OPENAI_API_BASE": ep.openai_url, "OPENAI_API_KEY": ep.api_key}
        return Plan(path, old, json.dumps(data, indent=2) + "\n", exports=_exports(env),
                    note="\n".join([*notes, f"then run: aider --model openai/{ep.model}"]))
    raise ClientError(f"unknown client {client!r}; choose from {choices(with_env=True)}")


def _exports(env: dict[str, str]) -> list[str]:
    import shlex

    return [f"export {k}={shlex.quote(v)}" for k, v in env.items()]


def launch_command(client: Client, ep: Endpoint, args: list[str], *,
                   force: bool = False) -> tuple[list[str], dict[str, str], str]:
    """argv, the environment additions that point a client at the server without touching its files, and a
    note for the user (what was adapted to make the client's prompt fit, or '')."""
    if client not in AGENTS:
        raise ClientError(f"launch runs one of {choices(with_env=False)}, not {client.value}")
    limits = client_fit(client, ep, force=force)
    note = limits.note if limits is not None else ""
    if client is Client.CLAUDE:
        return ["claude", *args], claude_env(ep, limits), note
    limits = _required(limits, ep)
    if client is Client.CODEX:
        provider = _inline_toml(codex_provider(ep, True, per_launch=True))
        settings = [a for k, v in codex_settings(limits).items() for a in ("-c", f"{k}={json.dumps(v)}")]
        argv = ["codex", "-c", f"model_providers.{PROVIDER_ID}={provider}", "-c", f"model_provider={PROVIDER_ID}",
                *settings, "-m", ep.model, *args]
        return argv, {KEY_ENV: ep.api_key}, note
    if client is Client.OPENCODE:
        config = opencode_config(ep, limits, per_launch=True)
        env = {"OPENCODE_CONFIG_CONTENT": json.dumps(config), KEY_ENV: ep.api_key, **OPENCODE_QUIET_ENV}
        return ["opencode", *args], env, note
    # aider reads model limits only from a file: ours lives in agentbox's state dir, not the user's.
    meta = state_dir() / "aider.model.metadata.json"
    meta.write_text(json.dumps(aider_metadata(ep, limits), indent=2))
    # the fleet's routing key as litellm extra_headers (a settings file is YAML; JSON is YAML)
    settings = state_dir() / "aider.model.settings.yml"
    settings.write_text(json.dumps([{"name": f"openai/{ep.model}",
                                     "extra_params": {"extra_headers": routing_headers(True)}}]))
    argv = ["aider", "--model", f"openai/{ep.model}", "--model-metadata-file", str(meta),
            "--model-settings-file", str(settings), "--no-show-model-warnings", "--no-check-update", "--analytics-disable", *args]
    return argv, {"OPENAI_API_BASE": ep.openai_url, "OPENAI_API_KEY": ep.api_key}, note


def _inline_toml(table: dict[str, Any]) -> str:
    """A TOML inline table for `codex -c` (values JSON-quoted, which TOML reads; nested tables inline too)."""
    items = (f"{json.dumps(k) if not k.isidentifier() else k}="
             f"{_inline_toml(v) if isinstance(v, dict) else json.dumps(v)}" for k, v in table.items())
    return "{" + ", ".join(items) + "}"
