"""The README's first command, as a new user runs it on a machine without a GPU: a copy of this repository
(tracked files and working-tree changes, no .venv), `./install.sh && .venv/bin/agentbox serve` there (the
install included, into a fresh .venv; pip's wheel cache may be reused), one chat request with the official
openai client under the model name the CLI printed, `agentbox stop`, and no process left behind."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
from pathlib import Path

import httpx
import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
INSTALL_AND_SERVE_TIMEOUT_S = 1500  # a fresh install on a busy 2-core machine, then the model's load and canary


def readme_first_command() -> str:
    """The first line of the README's first bash block, without its comment."""
    block = re.search(r"```bash\n(.*?)\n", (ROOT / "README.md").read_text())
    assert block, "the README has no ```bash block"
    return block.group(1).split("#")[0].strip()


def copy_repository(dest: Path) -> None:
    """What a fresh clone of this working tree holds: tracked and untracked-but-not-ignored files."""
    names = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT, check=True,
        capture_output=True,
    ).stdout.decode().split("\0")
    for name in filter(None, names):
        src = ROOT / name
        if src.is_file():  # a tracked file deleted in the working tree is not in the clone-to-be
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs the git checkout")
def test_readme_first_command_serves_the_embedded_model_on_a_fresh_copy(tmp_path: Path) -> None:
    from openai import OpenAI

    command = readme_first_command()
    assert command == "./install.sh && .venv/bin/agentbox serve", command
    repo, home = tmp_path / "agentbox", tmp_path / "home"
    copy_repository(repo)
    assert not (repo / ".venv").exists()
    port = _free_port()  # the default 8000 may be taken on a shared machine: the only change to the command
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "AGENTBOX_PROFILES", "PYTHONPATH", "AGENTBOX_DISK_CACHE_GB")}
    env |= {"AGENTBOX_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if ".venv" not in p)
    agentbox = str(repo / ".venv/bin/agentbox")
    procs: list[psutil.Process] = []
    try:
        try:
            r = subprocess.run(["bash", "-c", f"{command} --port {port}"], cwd=repo, env=env, capture_output=True,
                               text=True, timeout=INSTALL_AND_SERVE_TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:
            pytest.fail(f"install + serve did not finish within {INSTALL_AND_SERVE_TIMEOUT_S} s:\n{exc.stderr!r}")
        assert r.returncode == 0, f"`{command}` exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        served = re.search(r"agentbox is serving (\S+) at (http://\S+)/v1 \(pid (\d+)\)", r.stdout)
        assert served, f"serve printed no 'agentbox is serving' line:\n{r.stdout}"
        name, url, pid = served.group(1), served.group(2), int(served.group(3))
        assert "SmolLM2-135M-Instruct" in name
        assert "Traceback" not in r.stderr and "[bold]" not in r.stderr
        assert "!!" not in r.stdout + r.stderr  # setuptools' editable-install warning block (setup.py says why)
        server = psutil.Process(pid)
        procs = [server, *server.children(recursive=True)]
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200

        reply = OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120).chat.completions.create(
            model=name, messages=[{"role": "user", "content": "Say hi."}], max_tokens=8, temperature=0,
        )
        assert reply.choices[0].message.content and reply.usage and reply.usage.completion_tokens >= 1

        stop = subprocess.run([agentbox, "stop"], cwd=repo, env=env, capture_output=True, text=True, timeout=120)
        assert stop.returncode == 0 and f"stopped agentbox (pid {pid}" in stop.stdout, stop.stdout + stop.stderr
        gone, alive = psutil.wait_procs(procs, timeout=30)
        assert not alive, f"left running after stop: {[(p.pid, p.name()) for p in alive]}"
        assert not (home / "server.json").exists()
        log = (home / "server.log").read_text()
        assert "Traceback" not in log and " ERROR " not in log, log[-3000:]
        with socket.socket() as s:  # the port is free again (for a listener: TIME_WAIT of closed connections aside)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
            s.listen()
    finally:
        if (home / "server.json").exists():
            subprocess.run([agentbox, "stop"], cwd=repo, env=env, capture_output=True, timeout=120)
        for p in procs:
            if p.is_running():
                p.send_signal(signal.SIGKILL)
