"""Issue 12's server-side defects against real servers: tools reach a model whose template has none
(count_tokens counts them), HEAD /, Anthropic-shaped 401, output_config.format enforced, Codex's
session-id header, engine log lines in `agentbox logs`, --max-model-len above the model's, and the API-key
flow through setup / launch / check tools."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import anthropic
import httpx
import pytest

from agentbox.config import CPU_PAGE_SIZE

MODEL = "SmolLM2-135M-Instruct.Q4_1"
pytestmark = pytest.mark.slow
TOOL = {"name": "read_file", "description": "Read one file.",
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}
ASK = [{"role": "user", "content": "Read setup.py"}]


def test_count_tokens_counts_the_tools_the_model_reads(live_server: str, agentbox_home: Path) -> None:
    client = anthropic.Anthropic(base_url=live_server, api_key="unused", max_retries=0)
    bare = client.messages.count_tokens(model=MODEL, messages=ASK).input_tokens
    with_tools = client.messages.count_tokens(model=MODEL, messages=ASK, tools=[TOOL]).input_tokens
    assert with_tools > bare + 50, (bare, with_tools)
    r = client.messages.create(model=MODEL, max_tokens=64, messages=ASK, tools=[TOOL],
                               tool_choice={"type": "tool", "name": "read_file"}, extra_body={"temperature": 0})
    assert r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0) == with_tools
    assert [b.type for b in r.content] == ["tool_use"] and "path" in r.content[0].input
    log = (agentbox_home / "server.log").read_text()
    assert log.count("has no tools section") == 1  # warned once per model, not per request


def test_head_root_output_config_and_session_id_header(live_server: str) -> None:
    assert httpx.head(live_server + "/").status_code == 200
    schema = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 20}}, "required": ["title"]}
    r = httpx.post(live_server + "/v1/messages", timeout=120, json={
        "model": MODEL, "max_tokens": 64, "messages": [{"role": "user", "content": "Name this chat."}],
        "output_config": {"format": {"type": "json_schema", "schema": schema}}, "temperature": 0})
    assert r.status_code == 200, r.text
    title = json.loads(r.json()["content"][0]["text"])
    assert isinstance(title["title"], str) and len(title["title"]) <= 20
    bad = httpx.post(live_server + "/v1/messages", timeout=30, json={
        "model": MODEL, "max_tokens": 8, "messages": ASK, "output_config": {"format": {"type": "xml"}}})
    assert bad.status_code == 400 and bad.json()["type"] == "error" and "output_config" in bad.json()["error"]["message"]
    r = httpx.post(live_server + "/v1/responses", headers={"session-id": "codex-sess-42"}, timeout=120,
                   json={"model": MODEL, "input": "hi", "max_output_tokens": 4})
    assert r.status_code == 200, r.text
    ids = [s["id"] for s in httpx.get(live_server + "/v1/sessions", timeout=10).json()["data"]]
    assert "codex-sess-42" in ids


def test_engine_lines_reach_agentbox_logs(live_server: str, agentbox_home: Path) -> None:
    env = {**os.environ, "AGENTBOX_HOME": str(agentbox_home)}
    out = subprocess.run([sys.executable, "-m", "agentbox.cli.main", "logs", "-n", "400"], env=env, capture_output=True,
                         text=True, timeout=60).stdout
    assert "KV pool" in out and "max_model_len 2048" in out


def test_max_model_len_above_the_models_is_an_error(smollm2_path: Path, smollm2_loaded) -> None:  # noqa: ANN001
    from agentbox.config import EngineConfig
    from agentbox.engine.core import EngineCore

    with pytest.raises(ValueError, match="--max-model-len 32768 is above the 8192 positions this model supports"):
        EngineCore(EngineConfig(model=str(smollm2_path), max_model_len=32768, num_pages=64), loaded=smollm2_loaded)
    assert EngineCore(EngineConfig(model=str(smollm2_path), max_model_len=4096, num_pages=8192 // CPU_PAGE_SIZE),
                      loaded=smollm2_loaded).max_model_len == 4096


@pytest.fixture(scope="module")
def keyed_server(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """A second server, started with --api-key, in its own state dir (so setup reads its state)."""
    import socket

    home = tmp_path_factory.mktemp("keyed")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "AGENTBOX_HOME": str(home / "state"), "HOME": str(home / "home")}
    (home / "home").mkdir()
    r = subprocess.run([sys.executable, "-m", "agentbox.cli.main", "serve", "--model", str(smollm2_path), "--port", str(port),
                        "--num-pages", str(4096 // CPU_PAGE_SIZE), "--max-model-len", "2048", "--api-key", "sekrit"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    try:
        yield f"http://127.0.0.1:{port}", env
    finally:
        subprocess.run([sys.executable, "-m", "agentbox.cli.main", "stop"], env=env, capture_output=True, timeout=60)


def test_api_key_flow_setup_launch_check(keyed_server: tuple[str, dict], tmp_path: Path) -> None:
    url, env = keyed_server
    r = httpx.post(url + "/v1/messages", json={"model": MODEL, "max_tokens": 4, "messages": ASK}, timeout=30)
    assert r.status_code == 401 and r.json() == {"type": "error", "error": {
        "type": "authentication_error", "message": "invalid x-api-key"}}
    assert httpx.head(url + "/").status_code == 200  # Claude Code's probe needs no key

    def cli(*args: str, **kw: object) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "agentbox.cli.main", *args], env={**env, **kw.pop("extra", {})},  # type: ignore[dict-item]
                              capture_output=True, text=True, timeout=600)

    # A 2048-token context cannot hold these clients' own prompts: setup refuses, --force writes anyway
    refused = cli("setup", "codex")
    assert refused.returncode == 1 and "codex's own prompt" in refused.stderr and "Traceback" not in refused.stderr
    assert cli("setup", "codex", "--force").returncode == 0
    home = Path(env["HOME"])
    import tomllib

    codex = tomllib.loads((home / ".codex" / "config.toml").read_text())
    assert codex["model_context_window"] == 2048 and codex["model_auto_compact_token_limit"] == 2048 - 512
    assert codex["model_providers"]["agentbox"]["env_key"] == "AGENTBOX_API_KEY"
    assert cli("setup", "opencode-ai", "--force").returncode == 0
    text = (home / ".config" / "opencode" / "opencode.json").read_text()
    oc = json.loads(text)["provider"]["agentbox"]
    assert "sekrit" not in text and oc["options"]["apiKey"] == "{env:AGENTBOX_API_KEY}"
    assert oc["models"]["agentbox"]["limit"] == {"context": 2048, "output": 512}  # the stable alias
    assert cli("setup", "claude-code", "--force").returncode == 0
    claude = json.loads((home / ".claude" / "settings.json").read_text())["env"]
    assert claude["ANTHROPIC_AUTH_TOKEN"] == "sekrit" and claude["CLAUDE_CODE_AUTO_COMPACT_WINDOW"] == "2048"
    assert (home / ".claude" / "settings.json").stat().st_mode & 0o077 == 0
    # launch: a stand-in client prints what it was given; the key comes from the server's state
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "codex").write_text('#!/bin/sh\necho "KEY=$AGENTBOX_API_KEY ARGS=$*"\n')
    (bin_dir / "codex").chmod(0o755)
    out = cli("launch", "codex", "--force", "exec", "hi", extra={"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"})
    assert out.returncode == 0, out.stderr
    assert "KEY=sekrit" in out.stdout and "model_context_window=2048" in out.stdout
    # Claude Code's own prompt does not fit 2048 tokens: launch refuses with the numbers
    (bin_dir / "claude").write_text("#!/bin/sh\necho ran\n")
    (bin_dir / "claude").chmod(0o755)
    out = cli("launch", "claude", "-p", "hi", extra={"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"})
    assert out.returncode != 0 and "ran" not in out.stdout
    assert "20,300 tokens" in out.stderr + out.stdout and "2,048" in out.stderr + out.stdout
    # check tools with the key from --api-key (and a wrong key fails clearly)
    bad = cli("check", "tools", "--url", url, "--api-key", "wrong")
    assert bad.returncode != 0 and "requires an API key" in bad.stderr + bad.stdout
    ok = cli("check", "tools", "--url", url, "--api-key", "sekrit")
    assert ok.returncode == 0, ok.stdout + ok.stderr
