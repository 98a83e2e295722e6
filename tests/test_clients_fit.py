"""What a user sees from `agentbox setup` / `agentbox launch` (issues 20, 50): one client vocabulary with the long
forms as aliases; a client whose own prompt cannot fit the served context with room to work is refused with the
numbers and the fix, every client alike, or told a smaller output limit and told so; keys never land in a
world-readable file; each client's non-essential traffic is off; setup merges (earlier opencode models stay)
and leaves no marker files."""

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


def test_every_client_that_cannot_fit_8k_is_refused_with_the_numbers_and_the_fix(home: Path) -> None:
    """Claude Code, Codex and opencode on the embedded model's 8k context: each refused alike, naming its prompt,
    what it needs, the served context and the one model agentbox suggests; aider's small prompt fits."""
    for client in (Client.CLAUDE, Client.CODEX, Client.OPENCODE):
        need = CLIENT_PROMPT_TOKENS[client]
        with pytest.raises(ClientError) as e:
            setup_client(client.value, SMALL)
        msg = str(e.value)
        assert msg.startswith(f"{client.value}'s own prompt (system prompt and tools) is about {need:,} tokens; with "
                              f"4,096 to work in and a 256-token answer it needs a context of {need + 4352:,}, and "
                              "this server's is 8,192; serve a model with a longer context"), msg
        assert msg.endswith("; --force goes ahead anyway")
        with pytest.raises(ClientError, match="needs a context of"):
            launch_command(client, SMALL, [])
    assert not (home / ".claude").exists() and not (home / ".codex").exists() and not (home / ".config").exists()
    assert setup_client("aider", SMALL)[0].startswith("wrote")
    # the CLI: exit 1, one error line naming the fix, no traceback; --force writes it anyway, its prompt below
    # the compaction point (an output limit of what the context leaves)
    ep = ("--url", "http://127.0.0.1:9", "--model", "m", "--context", "8192")
    r = run("setup", "codex-cli", *ep)
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit) and "serve a model with a longer context" in r.stderr
    forced = run("setup", "codex-cli", *ep, "--force")
    assert forced.exit_code == 0 and "note: --force: codex is told an output limit of 1,691" in forced.stdout
    assert tomllib.loads((home / ".codex" / "config.toml").read_text())["model_auto_compact_token_limit"] == 6501


def test_a_small_context_lowers_the_output_limit_and_touches_nothing_global(home: Path) -> None:
    """At 12k opencode's 7.7k prompt fits with room to work once its output limit is cut (compaction stays on,
    and nothing in opencode.json applies beyond agentbox's model); an earlier agentbox setup's global
    `compaction.auto = false` is removed; Codex gets the same compaction point through its own key."""
    mid = Endpoint(url=BIG.url, model="agentbox", context=12288, max_output=4096, served="tiny")
    path = home / ".config" / "opencode" / "opencode.json"
    path.parent.mkdir(parents=True)
    old = {"provider": {"agentbox": {"models": {}}, "other": {"npm": "x"}}, "compaction": {"auto": False}}
    path.write_text(json.dumps(old))
    lines = setup_client("opencode", mid)
    room = 12288 - CLIENT_PROMPT_TOKENS[Client.OPENCODE] - 4096
    assert any(line.startswith(f"note: opencode's own prompt is about 7,700 of this server's 12,288 tokens: it is "
                               f"told an output limit of {room:,} (not 3,072) so that it compacts past "
                               f"{12288 - room:,} tokens, with 4,096 to work in") for line in lines), lines
    data = json.loads(path.read_text())
    assert "compaction" not in data and data["provider"]["other"] == {"npm": "x"}
    assert data["provider"]["agentbox"]["models"]["agentbox"] == {"name": "tiny (agentbox)",
                                                                  "limit": {"context": 12288, "output": room}}
    _, env, note = launch_command(Client.OPENCODE, mid, ["run", "hi"])
    assert "OPENCODE_DISABLE_AUTOCOMPACT" not in env and "compaction" not in json.loads(env["OPENCODE_CONFIG_CONTENT"])
    assert note.startswith("note: opencode's own prompt")
    # a user's own compaction setting (not agentbox's old one) stays
    path.write_text(json.dumps({"compaction": {"auto": False}}))
    setup_client("opencode", mid)
    assert json.loads(path.read_text())["compaction"] == {"auto": False}
    setup_client("codex", mid)
    codex = tomllib.loads((home / ".codex" / "config.toml").read_text())
    assert codex["model_auto_compact_token_limit"] == 12288 - (12288 - 6500 - 4096)
    # on a long context nothing is adapted
    _, env, note = launch_command(Client.OPENCODE, BIG, [])
    assert note == ""


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
