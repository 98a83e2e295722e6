"""How many cores a CPU step runs on.

`agentbox serve` leaves one core to the API process (engine/exec/runner.py `_set_threads`): it tokenizes, and it
streams a decoding sequence's tokens while the next step runs, and a spinning OpenMP thread that shares its core
with it stalls every barrier of the step (measured 5x slower at 2 threads than at 1 on 2 cores with the API
process busy). A step that is mostly prompt takes every core for its whole forward (the linears as well as the
attention): the API process has little to do while it runs, and such a step is long enough that a few ms of it
do not matter. Unless other processes keep those cores busy: then two spinning threads on one core make the step
many times slower (a 2,000-token prefill took 54 s instead of 2.3 with another job's two processes on the cores),
so the cores are taken only when the machine's CPU time outside this process says they are free (`Spare`).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from agentbox.engine.exec.step_inputs import StepInputs

# Query x key pairs from which a prompt-extending step takes every core (~1 ms of one core's attention kernel at
# head size 16): below it, waking a second thread costs more than it saves.
LONG_ATTENTION = 1 << 20
# Tokens from which a step takes every core even while other sequences decode: a prefill chunk or a warm agent
# turn's tool result (~300 tokens: 0.67 s on one core of a 2-core EPYC for the Qwen3.5 hybrid of
# bench/qwen3_5_hybrid_hf.py, 0.37 s on two). The API process streams the other sequences' tokens between such
# steps: a few ms against hundreds.
WIDE_STEP_TOKENS = 64
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
        self._stat, self._tick = stat, os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
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
        busy = self._busy_s()
        if busy is None:
            return True
        own, now = sum(os.times()[:2]), time.monotonic()
        if self._last is None:
            self._last = (now, busy, own)
            return True
        t0, busy0, own0 = self._last
        if now - t0 >= LOOK_S:
            self.others = max(0.0, (busy - busy0) - (own - own0)) / (now - t0)
            self._last = (now, busy, own)
        return self.others < BUSY_OTHERS


def step_threads(step: StepInputs, device: torch.device, configured: int | None, tp: int, spare: Spare) -> int | None:
    """Every core for a step of at least WIDE_STEP_TOKENS tokens (a prefill chunk, a warm agent turn's tool
    result, even beside other sessions' decodes), or one that only extends prompts over long contexts (a warm
    turn's ~30 tokens over 121k keys: 8 ms of one core's attention, 60 % of that turn's time to first token),
    when no other process keeps the cores busy; None (the engine's own count) otherwise. An explicit
    `cpu_threads` is kept, and tensor-parallel ranks keep their share."""
    if device.type != "cpu" or configured is not None or tp > 1:
        return None
    cores = os.cpu_count() or 1
    if cores <= torch.get_num_threads():
        return None
    if sum(step.query_lens) < WIDE_STEP_TOKENS:
        if min(step.query_lens) == 1 or int(step.sample_rows.numel()) > len(step.query_lens):
            return None  # a decode (or a verify, which samples every row): the API process streams its tokens
        if sum(q * kv for q, kv in zip(step.query_lens, step.kv_lens, strict=True)) < LONG_ATTENTION:
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
