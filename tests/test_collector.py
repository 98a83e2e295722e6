"""The cyclic collector waits for idle moments in the server's processes (agentbox/collector.py)."""

from __future__ import annotations

import gc
import weakref

from agentbox import collector


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_a_busy_stretch_leaves_cycles_to_the_idle_collection() -> None:
    old = gc.get_threshold()
    gc.collect()
    try:
        collector.after_startup()
        cycle = _Cycle()
        gone = weakref.ref(cycle)
        del cycle
        keep = [[i] for i in range(collector.IDLE_ALLOCATIONS * 3)]  # a turn's young containers, past 700
        assert gone() is not None  # no automatic collection inside the "turn"
        collector.collect_idle()
        assert gone() is None and gc.get_count()[0] < collector.IDLE_ALLOCATIONS
        del keep
        cycle = _Cycle()
        gone = weakref.ref(cycle)
        del cycle
        collector.collect_idle()  # too few allocations since: nothing worth a pass
        assert gone() is not None
    finally:
        gc.unfreeze()
        gc.set_threshold(*old)
        gc.collect()


class _Finished:
    pass


def test_free_when_idle_keeps_the_last_reference_until_the_idle_moment() -> None:
    collector.collect_idle()  # nothing kept from before
    first = _Finished()
    gone = weakref.ref(first)
    collector.free_when_idle(first)
    del first
    assert gone() is not None  # the page-table row let go; the object waits for the idle moment
    collector.collect_idle()
    assert gone() is None
    # a busy stretch with no idle moment: at most HELD_AT_MOST are kept, the oldest goes first
    refs = []
    for _ in range(collector.HELD_AT_MOST + 1):
        obj = _Finished()
        refs.append(weakref.ref(obj))
        collector.free_when_idle(obj)
        del obj
    assert refs[0]() is None and all(r() is not None for r in refs[1:])
    collector.collect_idle()
    assert all(r() is None for r in refs)
