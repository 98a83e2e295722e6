"""Idle cost of a running server: CPU time of the whole `agentbox serve` process tree (API process, engine
core, any helpers) over a quiet interval after warm-up. Design target: under 1 % of one core, because
idle means blocked (DESIGN.md, process model); a server spinning in a poll loop shows up here at once.
"""

from __future__ import annotations

import contextlib
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import psutil

from agentbox.bench.spawn import agentbox_command, spawned


@contextlib.contextmanager
def serve_subprocess(model: str, serve_args: Sequence[str] = ()) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """`agentbox serve --foreground` on a free loopback port with a throwaway AGENTBOX_HOME; yields the base
    URL and the process once /health answers; stops it whatever happens."""
    with tempfile.TemporaryDirectory(prefix="agentbox-idle-") as d, spawned(
        agentbox_command(model, serve_args), Path(d) / "serve.log"
    ) as (url, proc):
        yield url, proc


def _tree_cpu(root: psutil.Process) -> dict[int, tuple[str, float]]:
    """pid -> (name, user + system CPU seconds) for the process and all its descendants alive now."""
    out: dict[int, tuple[str, float]] = {}
    for p in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            t = p.cpu_times()
            out[p.pid] = (p.name(), t.user + t.system)
    return out


def tree_cpu_over(pid: int, seconds: float) -> dict[str, Any]:
    """CPU the process tree of `pid` burns over `seconds` of wall time, as % of one core."""
    root = psutil.Process(pid)
    before, t0 = _tree_cpu(root), time.monotonic()
    time.sleep(seconds)  # the measurement itself: we must not add load while we watch
    after, wall = _tree_cpu(root), time.monotonic() - t0
    per = [
        {"pid": p, "name": name, "cpu_s": cpu - before.get(p, ("", 0.0))[1]} for p, (name, cpu) in after.items()
    ]
    total = sum(e["cpu_s"] for e in per)
    return {
        "seconds": wall,
        "cpu_s": total,
        "percent_of_one_core": 100.0 * total / wall,
        "processes": per,
        "exited_during": sorted(set(before) - set(after)),
    }


def measure_idle_cpu(
    model: str, seconds: float, serve_args: Sequence[str] = (), warmup_requests: int = 3, settle_s: float = 1.0
) -> dict[str, Any]:
    """Start a server, warm it with a few real requests, let it settle, then measure its idle CPU."""
    with serve_subprocess(model, serve_args) as (url, proc), httpx.Client(base_url=url, timeout=300.0) as client:
        name = client.get("/health").json()["model"]
        for i in range(warmup_requests):
            r = client.post("/v1/completions", json={
                "model": name, "prompt": f"Request {i}: count to ten.", "max_tokens": 8, "ignore_eos": True,
            })
            r.raise_for_status()
        client.get("/v1/stats").raise_for_status()
        time.sleep(settle_s)  # let the last response's bookkeeping finish before the quiet interval starts
        return {"warmup_requests": warmup_requests, **tree_cpu_over(proc.pid, seconds)}
