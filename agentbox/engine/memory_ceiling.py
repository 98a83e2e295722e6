"""The engine process's memory ceiling: no request can take the machine's memory, whatever it does.

One request took the whole machine: a grammar that forces an endless output grew the engine to 16 GB in 33-53 s
until the kernel's global OOM killer ended it (and with it whatever else it chose). The API process now refuses
such grammars before they reach the engine (server/grammar_gate.py); this is the backstop for whatever is not
foreseen. Once the engine has loaded its model and allotted what the plan sized (weights, the KV pool, state
slots, the host tier), its data size is what the plan holds, measured by the kernel (so nothing the plan's
arithmetic leaves out, torch's own buffers, is missed); the ceiling is that plus the disk tier's bounded queues
plus `config.memory_margin_gb` for a step's activations. Past it an allocation fails in this process alone: a
request's grammar or stop check that fails is that request's error (core.py), a step that fails restarts the
engine; the machine never reaches its OOM killer.

RLIMIT_DATA, not RLIMIT_AS: it counts what the process can write (private writable mappings and the heap), not
the address space a CUDA runtime reserves and never touches (several times the GPU's memory).
"""

from __future__ import annotations

import logging
import resource

from agentbox.config import EngineConfig
from agentbox.engine.cache.disk_reader import AHEAD_BYTES
from agentbox.engine.cache.disk_writer import QUEUE_BYTES

log = logging.getLogger(__name__)


def status_bytes(key: str) -> int:
    """A size from /proc/self/status (`VmData`: private writable memory, touched or not; `VmSize`: the address
    space); 0 where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:  # not Linux: no ceilings (they are measured from here)
        pass
    return 0


def data_bytes() -> int:
    return status_bytes("VmData")


def apply(config: EngineConfig) -> int | None:
    """Set the ceiling (called once the engine is built); returns it in bytes, or None when off or unavailable."""
    if config.memory_margin_gb is None:
        return None
    held = data_bytes()
    if not held:
        return None
    ceiling = held + QUEUE_BYTES + AHEAD_BYTES + int(config.memory_margin_gb * 2**30)
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if hard != resource.RLIM_INFINITY:
        ceiling = min(ceiling, hard)
    try:
        resource.setrlimit(resource.RLIMIT_DATA, (ceiling, hard))
    except (ValueError, OSError) as e:
        log.warning("could not set the engine's memory ceiling (%s); it runs without one", e)
        return None
    log.info("engine memory ceiling: %.1f GiB (%.1f GiB held once loaded, %.1f GiB margin)", ceiling / 2**30,
             held / 2**30, (ceiling - held) / 2**30)
    return ceiling
