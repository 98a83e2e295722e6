"""Client setup writers on a temporary HOME: merge, backup, dry-run, undo; launch without files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from agentbox.clients import ClientError, Endpoint, launch_client, resolve_endpoint, setup_client, toml_writer
from agentbox.clients.files import backups

EP = Endpoint(url="http://127.0.0.1:8123", model="qwen3-8b", context=65536)


@pytest.fixture
def home(fake_home: Path) -> Path:
    return fake_home


def test_claude_code_merge_backup_undo(home: Path) -> None:
    path = home / ".claude" / "settings.json"
    path.parent.mkdir()
    original = '{"theme": "dark", "env": {"KEEP": "1", "ANTHROPIC_MODEL": "old"}, "permissions": {"allow": ["Bash"]}}'
    path.write_text(original)
    lines = setup_client("claude-code", EP)
    assert "backup" in lines[0]
    data = json.loads(path.read_text())
    assert data["theme"] == "dark" and data["permissions"] == {"allow": ["Bash"]}
    env = data["env"]
    assert env["KEEP"] == "1" and env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:8123"
    assert env["ANTHROPIC_MODEL"] == env["ANTHROPIC_DEFAULT_HAIKU_MODEL"] == "qwen3-8b"
    assert env["ANTHROPIC_DEFAULT_OPUS_MODEL"] == env["ANTHROPIC_DEFAULT_SONNET_MODEL"] == "qwen3-8b"
    assert env["CLAUDE_CODE_ATTRIBUTION_HEADER"] == "0" and env["ANTHROPIC_AUTH_TOKEN"]
    assert len(backups(path)) == 1
    assert "already set up" in setup_client("claude-code", EP)[0]  # idempotent: no second backup
    assert len(backups(path)) == 1
    setup_client("claude-code", EP, undo=True)
    assert path.read_text() == original and backups(path) == []
    with pytest.raises(ClientError):
        setup_client("claude-code", EP, undo=True)


def test_dry_run_prints_diff_and_writes_nothing(home: Path) -> None:
    diff, *exports = setup_client("opencode", EP, dry_run=True)
    assert "export OPENCODE_DISABLE_MODELS_FETCH=1" in exports
    assert diff.startswith("---") and '+      "npm": "@ai-sdk/openai-compatible",' in diff
    assert not (home / ".config").exists()


def test_codex_toml_merge_and_undo_of_a_new_file(home: Path) -> None:
    path = home / ".codex" / "config.toml"
    path.parent.mkdir()
    original = (
        '# my settings\nmodel = "gpt-5"\napproval_policy = "on-request"\n\n'
        '[model_providers.other]\nname = "Other"\nbase_url = "https://example.com/v1"\n\n'
        '[mcp_servers.fs]\ncommand = "npx"\nargs = ["-y", "fs-server"]\nenv = { A = "b" }\n'
    )
    path.write_text(original)
    setup_client("codex", EP)
    data = tomllib.loads(path.read_text())
    assert data["model"] == "qwen3-8b" and data["model_provider"] == "agentbox"
    assert data["approval_policy"] == "on-request"
    assert data["model_providers"]["other"]["base_url"] == "https://example.com/v1"
    assert data["mcp_servers"]["fs"] == {"command": "npx", "args": ["-y", "fs-server"], "env": {"A": "b"}}
    provider = data["model_providers"]["agentbox"]
    assert provider["wire_api"] == "responses" and provider["base_url"] == "http://127.0.0.1:8123/v1"
    setup_client("codex", EP, undo=True)
    assert path.read_text() == original
    # A file setup created is removed again by undo.
    path.unlink()
    setup_client("codex", EP)
    assert path.exists()
    setup_client("codex", EP, undo=True)
    assert not path.exists()


def test_opencode_provider_with_context_limit(home: Path) -> None:
    setup_client("opencode", EP)
    data = json.loads((home / ".config" / "opencode" / "opencode.json").read_text())
    provider = data["provider"]["agentbox"]
    assert provider["npm"] == "@ai-sdk/openai-compatible"
    assert provider["options"]["baseURL"] == "http://127.0.0.1:8123/v1"
    assert provider["models"]["qwen3-8b"]["limit"] == {"context": 65536, "output": 65536 // 4}
    assert data["model"] == "agentbox/qwen3-8b"


def test_export_clients_and_aider_metadata(home: Path) -> None:
    env = setup_client("env", EP)
    assert "export ANTHROPIC_BASE_URL=http://127.0.0.1:8123" in env and "export OPENAI_API_KEY=agentbox" in env
    assert not any(home.iterdir())
    aider = setup_client("aider", EP)
    assert "export OPENAI_API_BASE=http://127.0.0.1:8123/v1" in aider
    meta = json.loads((home / ".aider.model.metadata.json").read_text())["openai/qwen3-8b"]
    assert meta["max_input_tokens"] + meta["max_output_tokens"] == 65536 and meta["max_output_tokens"] == 16384
    with pytest.raises(ClientError):
        setup_client("vim", EP)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_endpoint_from_running_server_state(home: Path) -> None:
    # No server recorded and none on the URL asked (not the default 8000: a user's own server may run there).
    with pytest.raises(ClientError, match="no --model"):
        resolve_endpoint(f"http://127.0.0.1:{_free_port()}")
    assert resolve_endpoint(model="m").url == "http://127.0.0.1:8000"
    state = Path(os.environ["AGENTBOX_HOME"])
    state.mkdir(exist_ok=True)
    port = _free_port()
    (state / "server.json").write_text(json.dumps({"host": "0.0.0.0", "port": port, "pid": 1, "model": "smol"}))
    ep = resolve_endpoint()
    assert (ep.url, ep.model) == (f"http://127.0.0.1:{port}", "smol")
    assert resolve_endpoint("http://h:1/v1/", "m").url == "http://h:1"


def test_serve_keeps_what_setup_wrote_in_step_with_the_server(home: Path) -> None:
    """`agentbox serve` re-applies the remembered setups for its URL (clients/sync.py): the new context lands,
    backed up, under the stable model name; a client pointed elsewhere since, a server elsewhere, a context a
    client cannot fit and an undone setup are left alone, each said."""
    from agentbox.clients.sync import resync

    url = "http://127.0.0.1:8123"
    first = Endpoint(url=url, model="agentbox", context=65536, served="tiny-64k")
    for client in ("codex", "opencode", "claude"):
        setup_client(client, first)
    codex = home / ".codex" / "config.toml"
    second = Endpoint(url=url, model="agentbox", context=32768, served="tiny-32k")
    lines = resync(second)
    assert [line.split(":")[0] for line in lines] == ["claude", "codex", "opencode"]
    assert all(" for context 32,768 (backup: " in line for line in lines), lines
    data = tomllib.loads(codex.read_text())
    assert (data["model"], data["model_context_window"]) == ("agentbox", 32768) and len(backups(codex)) == 1
    opencode = json.loads((home / ".config" / "opencode" / "opencode.json").read_text())
    assert opencode["provider"]["agentbox"]["models"]["agentbox"]["name"] == "tiny-32k (agentbox)"
    assert resync(second) == []  # nothing changed: nothing written, nothing said
    assert resync(Endpoint(url="http://127.0.0.1:9", model="agentbox", context=8192)) == []
    codex.write_text(codex.read_text().replace('model_provider = "agentbox"', 'model_provider = "openai"'))
    assert resync(first)[1] == f"codex: {codex} points elsewhere now; left as it is"
    small = resync(Endpoint(url=url, model="agentbox", context=8192))
    assert small[0].startswith("claude: left as it is: claude's own prompt (system prompt and tools) is about 20,300")
    setup_client("opencode", first, undo=True)
    assert not any(line.startswith("opencode") for line in resync(Endpoint(url=url, model="agentbox", context=16384)))


def test_toml_writer_round_trip() -> None:
    data = {"a": 1, "b": "x \"q\" \\ é", "c": [1, 2], "t": True, "f": 1.5,
            "tab": {"k": "v", "sub": {"z": 0}, "inline": {"p": "q"}}, "arr": [{"n": 1}, {"n": 2, "o": {"x": "y"}}],
            "dotted key": {"1": "one"}}
    assert tomllib.loads(toml_writer.dumps(data)) == data


def test_launch_sets_env_and_touches_no_file(home: Path, tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "claude"
    fake.write_text('#!/bin/sh\necho "ARGS=$*"\necho "BASE=$ANTHROPIC_BASE_URL MODEL=$ANTHROPIC_MODEL"\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    out = subprocess.run(
        [sys.executable, "-m", "agentbox.cli.main", "launch", "claude", "--model", "m1", "--url", "http://x:1", "-p", "hi"],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "ARGS=-p hi" in out.stdout and "BASE=http://x:1 MODEL=m1" in out.stdout
    assert not any(home.iterdir())


def test_launch_without_the_client_installed(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(home))
    with pytest.raises(ClientError, match="not on PATH"):
        launch_client("codex", EP, [])


def test_setup_without_a_server_asks_for_the_context_and_undo_needs_none(home: Path) -> None:
    no_ctx = Endpoint(url="http://127.0.0.1:9", model="m")
    with pytest.raises(ClientError, match="pass --context"):
        setup_client("opencode", no_ctx)
    setup_client("opencode", EP)
    assert setup_client("opencode", no_ctx, undo=True)[0].startswith("removed")
    assert not (home / ".config" / "opencode" / "opencode.json").exists()
