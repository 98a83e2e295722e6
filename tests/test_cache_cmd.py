"""`agentbox cache clear`: it says what it would remove and asks; without a terminal to ask at it refuses unless
`--yes` (it wiped every saved session of every model without a word)."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentbox.cli.main import app
from agentbox.engine.cache.disk_listing import disk_root


def _namespace(key: str, model: str) -> Path:
    d = disk_root() / key
    d.mkdir(parents=True)
    (d / "meta.json").write_text(json.dumps({"model": model, "kv_dtype": "float32", "page_size": 16}))
    (d / "chunk-0.bin").write_bytes(b"\0" * 4096)
    return d


def _answer(answer: str) -> tuple[int, str]:
    """`agentbox cache clear` in a terminal, answered `answer`."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "agentbox.cli.main", "cache", "clear"], stdin=follower,
                            stdout=follower, stderr=follower, env=os.environ, close_fds=True)
    os.close(follower)
    out, deadline = b"", time.monotonic() + 60
    while b"[y/N]" not in out:
        assert time.monotonic() < deadline and proc.poll() is None, out
        out += os.read(leader, 4096)
    os.write(leader, answer.encode() + b"\n")
    proc.wait(timeout=60)
    try:
        while chunk := os.read(leader, 4096):
            out += chunk
    except OSError:  # the terminal closed with the process
        pass
    os.close(leader)
    return proc.returncode, out.decode(errors="replace")


def test_cache_clear_asks_first_and_refuses_without_a_terminal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTBOX_HOME", str(tmp_path))
    one = _namespace("aaaa1111", "SmolLM2-135M-Instruct.Q4_1")
    runner = CliRunner()
    r = runner.invoke(app, ["cache", "clear"])  # CliRunner's stdin is no terminal, as in a script
    assert r.exit_code == 1 and "this removes 1 namespace(s), 0.00 GiB of saved sessions (SmolLM2-135M-Instruct" \
        in r.output and "pass --yes" in r.output
    assert one.exists()
    code, out = _answer("n")
    assert code == 1 and "remove 1 namespace(s)" in out and "kept everything" in out and one.exists()
    code, out = _answer("y")
    assert code == 0 and "removed 1 namespace(s): aaaa1111" in out and not one.exists()
    two = _namespace("bbbb2222", "tiny")
    r = runner.invoke(app, ["cache", "clear", "bbbb", "--yes"])
    assert r.exit_code == 0 and "removed 1 namespace(s): bbbb2222" in r.output and not two.exists()
    assert "nothing to remove" in runner.invoke(app, ["cache", "clear"]).output
    missing = runner.invoke(app, ["cache", "clear", "zz", "--yes"])
    assert missing.exit_code == 1 and "no namespace starts with 'zz'" in missing.output
