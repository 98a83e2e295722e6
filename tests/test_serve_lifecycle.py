"""Starting and stopping the real server as a user does: `serve --foreground` is visible to `status` and
`logs` (which say it logs to its terminal) and Ctrl-C ends it without a traceback from any process; a
background server says its context and why, and stopped with `agentbox stop` leaves no ERROR line, no
nanobind leak report and no "Press CTRL+C" in its log, and no process behind; Ctrl-C while a background server
starts cancels it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
from test_cli_errors import agentbox

from agentbox.config import CPU_PAGE_SIZE

SMALL = ["--max-model-len", "512", "--num-pages", str(1024 // CPU_PAGE_SIZE), "--max-num-seqs", "4"]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(port: int, proc: subprocess.Popen[str], timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"serve --foreground exited {proc.returncode} before it was healthy:\n{proc.stdout.read()}")  # type: ignore[union-attr]
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)  # a test waiting on a server it started, not the server itself
    pytest.fail(f"serve --foreground was not healthy on port {port} within {timeout_s:.0f} s")


@pytest.mark.slow
def test_foreground_status_logs_and_ctrl_c(smollm2_path: Path, tmp_path: Path) -> None:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentbox.cli.main", "serve", "--foreground", "--model", str(smollm2_path),
         "--port", str(port), *SMALL],
        env={**os.environ, "AGENTBOX_HOME": str(tmp_path), "AGENTBOX_DEBUG": ""}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,  # its own group: Ctrl-C's target below
    )
    tree: list[psutil.Process] = []
    try:
        _wait_healthy(port, proc)
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        assert len(tree) >= 2  # the API process and the engine core process

        status = agentbox("status", home=tmp_path)
        assert status.returncode == 0, status.stderr
        assert "log: none: it runs in the foreground and logs to its terminal" in status.stdout
        assert str(tmp_path / "server.log") not in status.stdout
        logs = agentbox("logs", home=tmp_path)
        assert logs.returncode == 0 and "agentbox runs in the foreground" in logs.stdout, logs.stdout + logs.stderr

        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: every process of the group
        out, _ = proc.communicate(timeout=120)
        assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
        assert "engine failed" not in out and " ERROR " not in out, out
        _, alive = psutil.wait_procs(tree, timeout=30)
        assert not alive, [p.pid for p in alive]
        assert not (tmp_path / "server.json").exists()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


@pytest.mark.slow
def test_agentbox_stop_is_clean(smollm2_path: Path, tmp_path: Path) -> None:
    port = _free_port()
    start = agentbox("serve", "--model", str(smollm2_path), "--port", str(port), *SMALL, home=tmp_path, timeout=600)
    try:
        assert start.returncode == 0, start.stdout + start.stderr
        assert "  context 512 tokens (--max-model-len)\n" in start.stdout, start.stdout
        pid = int(start.stdout.split("(pid ")[1].split(")")[0])
        tree = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        stop = agentbox("stop", home=tmp_path)
        assert stop.returncode == 0 and f"stopped agentbox (pid {pid}" in stop.stdout
        _, alive = psutil.wait_procs(tree, timeout=30)
        assert not alive
        log = (tmp_path / "server.log").read_text()
        assert "engine stopped" in log  # the shutdown was logged, as what it is
        assert " ERROR " not in log and "engine failed" not in log and "Traceback" not in log, log[-3000:]
        # Triton is not imported on a CPU server: its nanobind module reported ~600 leaked objects at every exit
        assert "nanobind" not in log and "leaked" not in log, log[-3000:]
        assert "Press CTRL+C" not in log and "Uvicorn running on" in log  # no terminal to press it in
    finally:
        agentbox("stop", home=tmp_path)


@pytest.mark.slow
def test_ctrl_c_while_a_background_server_starts_cancels_it(smollm2_path: Path, tmp_path: Path) -> None:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentbox.cli.main", "serve", "--model", str(smollm2_path), "--port", str(port), *SMALL],
        env={**os.environ, "AGENTBOX_HOME": str(tmp_path), "AGENTBOX_DEBUG": ""}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
        # as a shell starts a foreground job: Ctrl-C's default (pytest-xdist's workers ignore SIGINT, and an
        # ignored SIGINT is inherited: the CLI would never see it)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 120
        while not (children := psutil.Process(proc.pid).children(recursive=True)):  # spawned: it is starting
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.1)
        server = children[0]
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in the terminal: the CLI's group (the server has its own session)
        time.sleep(0.2)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)  # and again, as people do: the cleanup still finishes
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 130 and "Traceback" not in err, err
        assert "error: cancelled: the starting server was stopped" in err
        _, alive = psutil.wait_procs([server], timeout=30)
        assert not alive and not (tmp_path / "server.json").exists()
        time.sleep(3)  # it used to come up anyway some seconds later
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
    finally:  # whatever went wrong, no server of this test outlives it
        if proc.poll() is None:
            proc.kill()
        agentbox("stop", home=tmp_path)
