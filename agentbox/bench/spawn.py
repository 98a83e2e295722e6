"""Targets of a comparison: external servers by URL, agentbox started once per cache policy, llama-server
(bench/llama_server.py).

A spawned server gets a free loopback port, its output goes to a log file under the output folder, and it
is stopped (SIGTERM, then SIGKILL) when its replay ends, whatever happened.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from agentbox.bench.replay import ReplayOptions, ReplayResult, replay_sync
from agentbox.bench.stats import RunStats, TurnRecord, summarize
from agentbox.trace import Session

READY_TIMEOUT_S = 600.0  # loading a model on CPU, or compiling kernels on first GPU start


@dataclass(frozen=True)
class Target:
    name: str
    url: str | None = None  # an external server: replayed as is
    command: list[str] | None = None  # a server to start: `{port}` in an argument is replaced
    ready_paths: tuple[str, ...] = ("/health", "/v1/models")
    note: str | None = None  # why a target was skipped (command and url both None)
    meta: dict[str, str] = field(default_factory=dict)
    stats_path: str | None = None  # the server's own counters, read once its replay ends (agentbox: /v1/stats)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def agentbox_command(model: str, serve_args: Sequence[str] = ()) -> list[str]:
    """`agentbox serve --foreground` on the placeholder port `{port}`, in this interpreter."""
    return [sys.executable, "-m", "agentbox.cli.main", "serve", "--foreground", "--port", "{port}", "--model", model,
            *serve_args]


def agentbox_target(model: str, policy: str, serve_args: list[str]) -> Target:
    return Target(
        name=f"agentbox-{policy}",
        command=agentbox_command(model, ["--cache-policy", policy, *serve_args]),
        ready_paths=("/health",),
        meta={"cache_policy": policy},
        stats_path="/v1/stats",
    )


def with_speculation_off(targets: list[Target]) -> list[Target]:
    """Each agentbox server the run starts, then the same server with `--speculative off` (`NAME-spec-off`):
    speculative decoding on (the default) and off over the same trace, in one run."""
    out: list[Target] = []
    for t in targets:
        out.append(t)
        if t.command is not None and t.command[1:3] == ["-m", "agentbox.cli.main"]:
            out.append(dataclasses.replace(t, name=f"{t.name}-spec-off", command=[*t.command, "--speculative", "off"],
                                           meta={**t.meta, "speculative": "off"}))
    return out


def parse_target(spec: str) -> Target:
    """`NAME=URL` from the command line."""
    name, sep, url = spec.partition("=")
    if not sep or not name or not url.startswith(("http://", "https://")):
        raise ValueError(f"--target wants NAME=URL, got {spec!r}")
    return Target(name=name, url=url)


@contextlib.contextmanager
def running(target: Target, log_path: Path, timeout_s: float = READY_TIMEOUT_S) -> Iterator[str]:
    """The target's base URL, with its server started and ready for the duration."""
    if target.url is not None:
        yield target.url
        return
    if target.command is None:
        raise ValueError(f"{target.name}: nothing to run ({target.note})")
    with spawned(target.command, log_path, target.ready_paths, timeout_s) as (url, _):
        yield url


@contextlib.contextmanager
def spawned(
    command: Sequence[str],
    log_path: Path,
    ready_paths: tuple[str, ...] = ("/health",),
    timeout_s: float = READY_TIMEOUT_S,
    home: str | None = None,
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """Start `command` (`{port}` replaced by a free loopback port), wait until one of `ready_paths` answers
    200, yield (base URL, process), and stop it whatever happens. Output goes to log_path. `home`: its
    state directory (a restart reuses one); default a fresh temporary one."""
    port = free_port()
    cmd = [a.replace("{port}", str(port)) for a in command]
    url = f"http://127.0.0.1:{port}"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    # Each spawned server gets its own state directory, so it neither collides with a server the user
    # runs (`serve` refuses a second one per directory) nor leaves server.json behind.
    fresh = contextlib.nullcontext(home) if home else tempfile.TemporaryDirectory(prefix="agentbox-bench-")
    with open(log_path, "ab" if home else "wb") as log, fresh as home:
        log.write((" ".join(cmd) + "\n").encode())
        log.flush()
        env = {**os.environ, "AGENTBOX_HOME": home}
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        try:
            _wait_ready(proc, url, ready_paths, timeout_s, log_path)
            yield url, proc
        finally:
            _stop(proc)


def _wait_ready(
    proc: subprocess.Popen[bytes], url: str, paths: tuple[str, ...], timeout_s: float, log_path: Path
) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=5.0) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {proc.returncode} before ready; see {log_path}:\n{_tail(log_path)}"
                )
            for path in paths:
                try:
                    if client.get(url + path).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
            time.sleep(0.5)  # a client waiting on a starting process: there is nothing to block on
    raise RuntimeError(f"server not ready after {timeout_s:.0f} s; see {log_path}:\n{_tail(log_path)}")


def _tail(log_path: Path, chars: int = 3000) -> str:
    """The end of a server's log: the cause is there, and the log may live in a folder about to go."""
    try:
        return log_path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        # Its own session (start_new_session): the whole group is only what we started, engine core included.
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


@dataclass(frozen=True)
class TargetRun:
    stats: RunStats
    records: list[TurnRecord]
    server_stats: dict[str, Any] | None = None  # the server's own view (evictions, demotions, its counters)


def run_targets(
    sessions: list[Session],
    targets: list[Target],
    options: ReplayOptions,
    out_dir: Path,
    on_start: Callable[[Target], Callable[[TurnRecord], None] | None] | None = None,
    notes: list[str] | None = None,
) -> list[TargetRun]:
    """Replay the same sessions against each target in turn (one at a time: they share the machine).

    A target that fails to start or to replay is recorded in `notes` and the comparison goes on.
    """
    runs: list[TargetRun] = []
    for target in targets:
        if target.url is None and target.command is None:
            if notes is not None:
                notes.append(f"{target.name}: skipped, {target.note}")
            continue
        on_turn = on_start(target) if on_start else None
        try:
            with running(target, out_dir / f"{target.name}.log") as url:
                result: ReplayResult = replay_sync(sessions, url, options, on_turn)
                server_stats = _server_stats(url, target.stats_path)
        except (RuntimeError, OSError, httpx.HTTPError) as e:
            if notes is not None:
                notes.append(f"{target.name}: failed, {e}")
            continue
        stats = summarize(target.name, result.records, result.wall_s, model=result.model, **target.meta)
        runs.append(TargetRun(stats=stats, records=result.records, server_stats=server_stats))
    return runs


def _server_stats(url: str, path: str | None) -> dict[str, Any] | None:
    """The server's own counters after the replay, or None (none offered, or not answering)."""
    if path is None:
        return None
    try:
        resp = httpx.get(url + path, timeout=10.0)
        return resp.json() if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
