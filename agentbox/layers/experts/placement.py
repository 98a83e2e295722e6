"""Where a MoE layer's routed experts live: with the rest of the model on its device, or in host RAM, run by
the CPU expert kernels (layers/experts/cpu.py) while the device runs attention, the router and the shared
expert (`serve --cpu-moe`: every MoE layer; `--n-cpu-moe N`: the first N, llama.cpp's flags).

The loader makes a placement current while the model is built (`placement_context`, as `quant_context` does
for the linear methods): each FusedMoE asks it for its home in construction order, which is layer order, so
"the first N" is the first N layers that have experts. A host layer builds its expert parameters on the CPU;
quantised experts there keep their scales in float32, the CPU kernels' input (a bf16 scale would round the
file's fp16 one), so the repack step of the loader gives them the kernels. On a CPU-only machine every layer
is already on the host: the flags change nothing but the report.

A step's hidden state crosses to the host once per host layer and its output once back. The clock counts the
seconds the host experts compute (after the copy in, before the copy out): the runner reads it per step for
/v1/stats and `agentbox top`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import Enum

import torch

ALL_LAYERS = 1 << 30  # `--cpu-moe`: more layers than any model has


class ExpertHome(Enum):
    DEVICE = "device"  # with the rest of the model (a GPU, or the CPU of a CPU-only machine)
    HOST = "host"  # host RAM, on the CPU expert kernels


@dataclass
class ExpertClock:
    """Seconds the host experts computed, and how many host-layer calls, since the last `take`."""

    seconds: float = 0.0
    calls: int = 0

    def add(self, seconds: float) -> None:
        self.seconds += seconds
        self.calls += 1

    def take(self) -> tuple[float, int]:
        out = (self.seconds, self.calls)
        self.seconds, self.calls = 0.0, 0
        return out


@dataclass
class ExpertTimes:
    """The runner's steps (rank 0) and the seconds the host experts computed in them, from the clock."""

    steps: int = 0
    step_s: float = 0.0
    cpu_expert_s: float = 0.0
    last_step_s: float = 0.0
    last_cpu_expert_s: float = 0.0

    def add(self, step_s: float, cpu_expert_s: float) -> None:
        self.steps += 1
        self.step_s += step_s
        self.cpu_expert_s += cpu_expert_s
        self.last_step_s, self.last_cpu_expert_s = step_s, cpu_expert_s


@dataclass
class ExpertPlacement:
    """The experts of the first `host_layers` MoE layers in host RAM; the rest on the model's device."""

    host_layers: int = 0
    homes: list[ExpertHome] = field(default_factory=list)  # per MoE layer, in order, as they were built
    clock: ExpertClock = field(default_factory=ExpertClock)

    @classmethod
    def of(cls, cpu_moe: bool, n_cpu_moe: int) -> ExpertPlacement:
        if n_cpu_moe < 0:
            raise ValueError(f"n_cpu_moe must be 0 or more (got {n_cpu_moe})")
        return cls(ALL_LAYERS if cpu_moe else n_cpu_moe)

    def take(self) -> ExpertHome:
        """The home of the next MoE layer built."""
        home = ExpertHome.HOST if len(self.homes) < self.host_layers else ExpertHome.DEVICE
        self.homes.append(home)
        return home

    @property
    def num_host(self) -> int:
        return sum(h is ExpertHome.HOST for h in self.homes)


_current: ExpertPlacement | None = None


@contextlib.contextmanager
def placement_context(placement: ExpertPlacement | None) -> Iterator[None]:
    """MoE layers built inside take their home from `placement` (the loader wraps model construction)."""
    global _current
    previous, _current = _current, placement
    try:
        yield
    finally:
        _current = previous


def current_placement() -> ExpertPlacement | None:
    return _current


@contextlib.contextmanager
def building_on(home: ExpertHome, dtype: torch.dtype | None) -> Iterator[None]:
    """Expert parameters of a host layer are made on the CPU, in `dtype` (None: the model's)."""
    if home is ExpertHome.DEVICE:
        yield
        return
    previous = torch.get_default_dtype()
    if dtype is not None:
        torch.set_default_dtype(dtype)
    try:
        with torch.device("cpu"):
            yield
    finally:
        torch.set_default_dtype(previous)


def timed(clock: ExpertClock) -> contextlib.AbstractContextManager[None]:
    return _Timed(clock)


class _Timed(contextlib.AbstractContextManager[None]):
    def __init__(self, clock: ExpertClock) -> None:
        self.clock = clock
        self.t0 = 0.0

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.clock.add(time.perf_counter() - self.t0)
