"""What a user sees from `agentbox setup` / `agentbox launch` (issue 20): one client vocabulary with the long
forms as aliases; a client whose own prompt cannot fit the served context is refused with the numbers or adapted
(smaller output limit, auto-compaction off) and told so; keys never land in a world-readable file; each client's
non-essential traffic is off; setup merges (earlier opencode models stay) and leaves no marker files."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from click.testing import Result
from typer.testing import CliRunner

from agentbox.clients import Client, ClientError, Endpoint, parse_client, setup_client
from agentbox.clients.fit import CLIENT_PROMPT_TOKENS
from agentbox.clients.targets import launch_command

BIG = Endpoint(url="http://127.0.0.1:8123", model="qwen3-8b", context=65536)
SMALL = Endpoint(url="http://127.0.0.1:8123", model="SmolLM2-135M-Instruct.Q4_1", context=8192)
KEYED = Endpoint(url="http://127.0.0.1:8123", model="qwen3-8b", context=65536, api_key="sekrit", has_key=True)


@pytest.fixture
def home(fake_home: Path) -> Path:
    return fake_home


def run(*args: str) -> Result:
    """The CLI in this process (the setup paths write files only; launch replaces its process, see `cli`)."""
    from agentbox.cli.main import app

    return CliRunner().invoke(app, list(args))


def cli(*args: str, path_dir: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if path_dir is not None:
        env["PATH"] = f"{path_dir}{os.pathsep}{env['PATH']}"
    return subprocess.run([sys.executable, "-m", "agentbox.cli.main", *args], env=env, capture_output=True, text=True,
                          timeout=120)


def stand_in(bin_dir: Path, name: str) -> None:
    """A client that prints what agentbox gave it."""
    bin_dir.mkdir(exist_ok=True)
    exe = bin_dir / name
    exe.write_text('#!/bin/sh\necho "ARGS=$*"\nenv | grep -E "^(OPENCODE|ANTHROPIC|CLAUDE|AGENTBOX)" | sort\n')
    exe.chmod(0o755)


def test_one_vocabulary_with_long_forms_as_aliases(home: Path, tmp_path: Path) -> None:
    assert parse_client("claude-code") is parse_client("Claude") is Client.CLAUDE
    assert parse_client("aider-chat") is Client.AIDER and parse_client("opencode-ai") is Client.OPENCODE
    r = cli("setup", "vim")  # as a user runs it: one line, exit 1, no traceback
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr == ("error: unknown client 'vim' for setup; choose from claude, codex, opencode, aider, env "
                        "(long forms such as claude-code also work)\n")
    for args, names in ((("launch", "vim"), "claude, codex, opencode, aider ("),
                        (("launch", "env"), "claude, codex, opencode, aider (")):
        r = run(*args)
        assert r.exit_code == 1 and isinstance(r.exception, SystemExit), r.output
        assert f"unknown client {args[1]!r} for launch; choose from {names}" in r.stderr
    # setup takes the short name and the long form alike, and so does launch (the stand-in echoes its argv)
    ep = ("--url", "http://127.0.0.1:9", "--model", "m", "--context", "65536")
    assert run("setup", "claude", *ep).exit_code == 0
    assert "already set up" in run("setup", "claude-code", *ep).stdout
    assert (home / ".claude" / "settings.json").exists()
    assert "removed" in run("setup", "CLAUDE_CODE", "--undo").stdout
    stand_in(tmp_path / "bin", "claude")
    r = cli("launch", "claude-code", "--url", "http://127.0.0.1:9", "--model", "m", "-p", "hi", path_dir=tmp_path / "bin")
    assert r.returncode == 0 and "ARGS=-p hi" in r.stdout, r.stderr


def test_opencode_on_an_8k_context_is_adapted_not_left_to_loop(home: Path) -> None:
    lines = setup_client("opencode", SMALL)
    need = CLIENT_PROMPT_TOKENS[Client.OPENCODE]
    note = next(line for line in lines if line.startswith("note:"))
    assert f"opencode's own prompt is about {need} of this server's 8192 tokens" in note
    assert f"it gets an output limit of {8192 - need} tokens and auto-compaction off" in note
    assert "agentbox serve --model" in note
    data = json.loads((home / ".config" / "opencode" / "opencode.json").read_text())
    model = data["provider"]["agentbox"]["models"][SMALL.model]
    assert model["limit"] == {"context": 8192, "output": 8192 - need}
    assert data["compaction"] == {"auto": False}
    # launch sets the same for that run only, in the environment
    _, env, note = launch_command(Client.OPENCODE, SMALL, ["run", "hi"])
    assert env["OPENCODE_DISABLE_AUTOCOMPACT"] == "1" and "auto-compaction off" in note
    assert json.loads(env["OPENCODE_CONFIG_CONTENT"])["compaction"] == {"auto": False}
    # on a long context nothing is adapted
    _, env, note = launch_command(Client.OPENCODE, BIG, [])
    assert note == "" and "OPENCODE_DISABLE_AUTOCOMPACT" not in env
    assert "compaction" not in json.loads(env["OPENCODE_CONFIG_CONTENT"])


def test_codex_adapts_and_claude_is_refused_on_8k(home: Path) -> None:
    lines = setup_client("codex", SMALL)
    assert any(line.startswith("note: codex's own prompt is about 6500 of this server's 8192 tokens: it gets "
                               "auto-compaction off") for line in lines), lines
    codex = tomllib.loads((home / ".codex" / "config.toml").read_text())
    assert codex["model_auto_compact_token_limit"] == 8192  # not 6144: below its own 6.5k prompt
    with pytest.raises(ClientError, match=r"claude's own prompt .* about 24800 tokens, but this server's context "
                                          r"is 8192 tokens .*--force"):
        setup_client("claude", SMALL)
    assert not (home / ".claude").exists()
    # the CLI: exit 1, one error line naming the fix, no traceback; --force writes it anyway
    ep = ("--url", "http://127.0.0.1:9", "--model", "m", "--context", "8192")
    r = run("setup", "claude-code", *ep)
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit) and "agentbox serve --model" in r.stderr
    assert run("setup", "claude-code", *ep, "--force").exit_code == 0


def test_keys_stay_out_of_readable_files_and_traffic_is_off(home: Path, tmp_path: Path) -> None:
    lines = setup_client("opencode", KEYED)
    path = home / ".config" / "opencode" / "opencode.json"
    text = path.read_text()
    assert "sekrit" not in text
    data = json.loads(text)
    assert data["provider"]["agentbox"]["options"]["apiKey"] == "{env:AGENTBOX_API_KEY}"
    assert data["autoupdate"] is False and data["share"] == "disabled"
    assert "export OPENCODE_DISABLE_MODELS_FETCH=1" in lines and any("export AGENTBOX_API_KEY=" in x for x in lines)
    setup_client("claude", KEYED)  # settings.json has no indirection: the key is written, owner-only
    settings = home / ".claude" / "settings.json"
    assert stat.S_IMODE(settings.stat().st_mode) == 0o600
    env = json.loads(settings.read_text())["env"]
    assert env["ANTHROPIC_AUTH_TOKEN"] == "sekrit" and env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1"
    setup_client("codex", KEYED)
    codex = tomllib.loads((home / ".codex" / "config.toml").read_text())
    assert "sekrit" not in (home / ".codex" / "config.toml").read_text()
    assert codex["check_for_update_on_startup"] is False and codex["analytics"] == {"enabled": False}
    argv, env, _ = launch_command(Client.CODEX, KEYED, ["exec", "hi"])
    assert "check_for_update_on_startup=false" in argv and "analytics.enabled=false" in argv
    _, env, _ = launch_command(Client.OPENCODE, KEYED, [])
    assert env["OPENCODE_DISABLE_MODELS_FETCH"] == env["OPENCODE_DISABLE_AUTOUPDATE"] == "1"
    assert env["AGENTBOX_API_KEY"] == "sekrit"


def test_setup_merges_opencode_models_and_leaves_no_markers(home: Path) -> None:
    path = home / ".config" / "opencode" / "opencode.json"
    setup_client("opencode", BIG)
    other = Endpoint(url=BIG.url, model="SmolLM2-135M-Instruct.Q4_1", context=65536)
    setup_client("opencode", other)
    models = json.loads(path.read_text())["provider"]["agentbox"]["models"]
    assert set(models) == {"qwen3-8b", "SmolLM2-135M-Instruct.Q4_1"}
    assert json.loads(path.read_text())["model"] == "agentbox/SmolLM2-135M-Instruct.Q4_1"
    assert not list(path.parent.glob("*.absent")) and len(list(path.parent.glob("*agentbox-backup*"))) == 1
    assert setup_client("opencode", other, undo=True)[0].startswith("restored")
    assert setup_client("opencode", other, undo=True)[0] == f"removed {path} (agentbox setup created it)"
    assert not path.exists() and not list(path.parent.iterdir())
    with pytest.raises(ClientError, match="no agentbox backup"):
        setup_client("opencode", other, undo=True)
