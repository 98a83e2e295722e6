"""Background serving: owns the state directory's server.json (pid, host, port, model) and server.log, and
start / stop / status over them. `python -m agentbox.cli.daemon CONFIG_JSON` is the background child."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

from agentbox.config import EngineConfig, ServerConfig, state_dir


def state_file() -> Path:
    return state_dir() / "server.json"


def log_file() -> Path:
    return state_dir() / "server.log"


API_KEY_ENV = "AGENTBOX_API_KEY"


def config_to_json(config: ServerConfig) -> str:
    """The config for the child's argv, without the API key: argv is world-readable (`ps`), so the key
    travels in the child's environment instead (readable by its user only)."""
    return json.dumps({**dataclasses.asdict(config), "api_key": None})


def config_from_json(text: str) -> ServerConfig:
    d = json.loads(text)
    d["api_key"] = d.get("api_key") or os.environ.get(API_KEY_ENV) or None
    d["cors_origins"] = tuple(d.get("cors_origins") or ())
    return ServerConfig(**{**d, "engine": EngineConfig(**d["engine"])})


def read_state() -> dict | None:
    """The running server's record, or None (a record whose process is gone is removed)."""
    try:
        st = json.loads(state_file().read_text())
    except (OSError, ValueError):
        return None
    pid = st.get("pid")
    if not isinstance(pid, int) or not psutil.pid_exists(pid):
        state_file().unlink(missing_ok=True)
        return None
    try:
        if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            state_file().unlink(missing_ok=True)
            return None
    except psutil.NoSuchProcess:
        return None
    return st


def state_dir_problem() -> str | None:
    """Why the state directory (server.json, server.log, models) cannot be written, with the fix; None if it can."""
    from agentbox.config import STATE_ENV

    try:
        d = state_dir()
        probe = d / f".write-test-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as exc:
        where = exc.filename or os.environ.get(STATE_ENV) or "the state directory"
        return (f"cannot write agentbox's state directory {where} ({exc.strerror})\n"
                f"  use one you own: export {STATE_ENV}=$HOME/.agentbox   (or fix its owner: sudo chown -R $USER {where})")
    return None


def write_state(config: ServerConfig, pid: int, model_name: str, log: Path | None) -> None:
    """`log`: the file the server writes to; None when it runs in the foreground and logs to its terminal."""
    st = {
        "pid": pid, "host": config.host, "port": config.port, "model": model_name,
        "model_path": config.engine.model, "started": time.time(), "log": str(log) if log else None,
        "api_key": config.api_key,  # read by setup / launch / check tools; the file is the user's alone
    }
    state_file().touch(mode=0o600)
    state_file().write_text(json.dumps(st, indent=2))


def clear_state(pid: int) -> None:
    try:
        if json.loads(state_file().read_text()).get("pid") == pid:
            state_file().unlink()
    except (OSError, ValueError):
        pass


def url_of(st: dict) -> str:
    host = st["host"] if st["host"] not in ("0.0.0.0", "::") else "127.0.0.1"
    return f"http://{host}:{st['port']}"


def health(st: dict, timeout: float = 2.0) -> dict | None:
    try:
        r = httpx.get(url_of(st) + "/health", timeout=timeout)
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def port_in_use(host: str, port: int) -> bool:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def spawn(config: ServerConfig) -> subprocess.Popen:
    """Starts the server detached from this terminal, its output appended to server.log."""
    log = open(log_file(), "ab")  # noqa: SIM115 - handed to the child
    log.write(f"\n{START_MARK} {time.strftime('%Y-%m-%d %H:%M:%S')} ====\n".encode())
    log.flush()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop(API_KEY_ENV, None)
    if config.api_key:
        env[API_KEY_ENV] = config.api_key
    return subprocess.Popen(
        [sys.executable, "-m", "agentbox.cli.daemon", config_to_json(config)],
        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env,
    )


def cancel(proc: subprocess.Popen, timeout: float = 15.0) -> None:
    """Stops a server that is still starting (its process and the engine's), and forgets its state."""
    try:
        procs = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.terminate()
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    proc.wait(timeout=5)
    clear_state(proc.pid)


def stop(timeout: float = 30.0) -> dict | None:  # the engine writes its cache to disk first (disk_flush_s)
    """Stops the running server (SIGTERM, then SIGKILL past the timeout). Returns what was stopped."""
    st = read_state()
    if st is None:
        return None
    pid = st["pid"]
    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
        proc.send_signal(signal.SIGTERM)
        _, alive = psutil.wait_procs(procs, timeout=timeout)
        for p in alive:
            p.kill()
        psutil.wait_procs(alive, timeout=5)
    except psutil.NoSuchProcess:
        pass
    clear_state(pid)
    return st


START_MARK = "==== agentbox serve"


def start_failure() -> str | None:
    """Why the engine of the last start failed, in its own words (a ValueError naming the flag to change, an
    out-of-memory), from server.log; None when the log does not say."""
    text = log_file().read_text(errors="replace") if log_file().exists() else ""
    found = re.findall(r"the engine could not start: (.+)$", text[text.rfind(START_MARK):], re.MULTILINE)
    return found[-1].strip() if found else None


def tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def run_foreground(config: ServerConfig, log: Path | None = None) -> None:
    """Serve in this process; `log` is where its output goes (the background child's server.log), None for a
    terminal."""
    from agentbox.server.app import run_server, served_name

    pid = os.getpid()
    write_state(config, pid, served_name(config), log)
    # SIGTERM from `agentbox stop` becomes uvicorn's graceful shutdown (it handles SIGINT/SIGTERM itself).
    try:
        run_server(config, detached=log is not None)
    except KeyboardInterrupt:
        pass  # Ctrl-C: uvicorn has shut down gracefully and re-raised the signal; nothing left to say
    finally:
        clear_state(pid)


if __name__ == "__main__":
    run_foreground(config_from_json(sys.argv[1]), log_file())  # spawn() sends our output there
