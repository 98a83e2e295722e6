"""The cyclic garbage collector runs while a server process is idle, not inside an agent's turn.

A warm turn at 128k tokens makes ~5k containers of a 0.6 MB body in the API process and 121k-id lists in the
engine. The automatic collections those allocations triggered (a young pass every 700 allocations, a middle
one every 10 of those, ~0.8 ms each with a 121k-element list in sight) landed inside the turn: ~0.8 ms of the
engine's and ~0.6 ms of the API process's time to first token per turn, on average (bench warm, Xeon). So after
startup what lives as long as the process is frozen out of the collector's sight, automatic collection starts
only past BUSY_ALLOCATIONS (a long busy stretch still collects), and each process collects what its turns
left behind when it goes idle: the engine before it blocks on an empty pipe, the API process when its last
request in flight ends. A leaf module.
"""

from __future__ import annotations

import gc

BUSY_ALLOCATIONS = 50_000  # young objects that start an automatic collection (the default: 700)
HELD_AT_MOST = 8  # objects free_when_idle keeps; past that the oldest goes at once
IDLE_ALLOCATIONS = 700  # fewer young objects than this: an idle moment collects nothing
FULL_EVERY = 10  # middle collections between two full ones (the default's ratio)


def after_startup() -> None:
    """What startup made (torch, transformers, the model, the tokenizer) lives as long as the process: frozen,
    so no collection walks it again (a full pass over it took 150-190 ms, landing on a turn)."""
    gc.freeze()
    gc.set_threshold(BUSY_ALLOCATIONS, FULL_EVERY, FULL_EVERY)


_held: list[object] = []


def free_when_idle(obj: object) -> None:
    """Keep the last reference to obj until the next collect_idle. Freeing a finished 128k-token request (its
    121k-id list) took 0.2-0.4 ms, inside the next turn's step where its page-table row was taken over."""
    _held.append(obj)
    if len(_held) > HELD_AT_MOST:  # a long busy stretch: no idle moment comes to free them
        del _held[0]


def collect_idle() -> None:
    """Free what free_when_idle kept and collect what the last turns left, now that nothing waits on this
    process; a full pass every FULL_EVERY."""
    _held.clear()
    young, _, middles = gc.get_count()
    if young >= IDLE_ALLOCATIONS:
        gc.collect(2 if middles >= FULL_EVERY else 1)
