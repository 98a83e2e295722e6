"""How many cores a CPU step runs on.

`agentbox serve` runs a step on every core while the machine's CPU time outside the engine says no other process
keeps them busy (`Spare`), and on all cores but one otherwise (engine/exec/runner.py `_set_threads`): a spinning
OpenMP thread that shares its core with another busy process stalls every barrier of the step, and the step gets
many times slower (a 2,000-token prefill on two threads took 54 s instead of 2.3 with another job's two
processes on the two cores; llama.cpp's threads fall from ~40 to ~4 tok/s the same way). On an otherwise idle
2-core EPYC every core is worth it, decode included: the API process's own work a token (detokenize, stream) is
a few percent of a core. Measured with the issue-52 agent workload, one session: the Qwen3.5 hybrid's decode 98
-> 126 tok/s and its wall 20.8 -> 17.3 s, SmolLM2's decode 42 -> 52 tok/s. The count covers the whole step, the
LM head and the MTP head included (they ran on the engine's one thread until the ninth session: the hybrid's
one-session wall 13.4 -> 12.1 s on a 2-core Xeon).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import torch

# Cores other processes may use on average (the API process streaming, the OS) for this process to take every
# core; a busy neighbour (a build, another engine) uses one or more.
BUSY_OTHERS = 0.5
# Shortest interval /proc/stat is read over (its counters tick every 10 ms); shorter: the last verdict stands.
LOOK_S = 0.25


class Spare:
    """Whether the cores beyond this process's own are free: the machine's busy CPU time (/proc/stat) less this
    process's (os.times, every thread) since the last look, per second of wall time. Where /proc/stat is missing
    every core counts as free."""

    def __init__(self, stat: Path = Path("/proc/stat")) -> None:
        self._stat, self._tick = stat, os.sysconf("SC_CLK_TCK") if os.name == "posix" else 100
        self._last: tuple[float, float, float] | None = None
        self.others = 0.0  # cores other processes used over the last interval
        self.free()  # the first interval starts here (the engine's start), not at the first step

    def _busy_s(self) -> float | None:
        try:
            fields = self._stat.read_text().split("\n", 1)[0].split()[1:]
        except OSError:
            return None
        # user nice system idle iowait irq softirq steal ...: idle and iowait are the free time
        ticks = [int(f) for f in fields[:8]]
        return (sum(ticks) - ticks[3] - ticks[4]) / self._tick

    def free(self) -> bool:
        """Reads /proc/stat at most once per LOOK_S (every step asks: a decode step is a few ms)."""
        now = time.monotonic()
        if self._last is not None and now - self._last[0] < LOOK_S:
            return self.others < BUSY_OTHERS
        busy = self._busy_s()
        if busy is None:
            return True
        own = sum(os.times()[:2])
        if self._last is not None:
            t0, busy0, own0 = self._last
            self.others = max(0.0, (busy - busy0) - (own - own0)) / (now - t0)
        self._last = (now, busy, own)
        return self.others < BUSY_OTHERS


def step_threads(device: torch.device, configured: int | None, tp: int, spare: Spare) -> int | None:
    """Every core for a step while no other process keeps them busy; None (the engine's own count: all cores but
    one) otherwise. An explicit `cpu_threads` is kept, and tensor-parallel ranks keep their share."""
    if device.type != "cpu" or configured is not None or tp > 1:
        return None
    cores = os.cpu_count() or 1
    if cores <= torch.get_num_threads():
        return None
    return cores if spare.free() else None


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """torch's thread count inside (and so the C kernels', which take cpu_gemv.threads()); None: unchanged."""
    if threads is None:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
