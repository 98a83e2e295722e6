"""The CPU step's thread count: a prompt-heavy step takes the spare cores only while other processes leave them
free (engine/exec/cpu_threads.py `Spare`), read from a /proc/stat written here."""

from __future__ import annotations

import os
import time
from pathlib import Path

from agentbox.engine.exec.cpu_threads import LOOK_S, Spare


def _stat(path: Path, busy: int, idle: int) -> None:
    # cpu user nice system idle iowait irq softirq steal (ticks)
    path.write_text(f"cpu  {busy} 0 0 {idle} 0 0 0 0 0 0\ncpu0 0 0 0 0 0 0 0 0 0 0\n")


def test_spare_cores_follow_other_processes_cpu_time(tmp_path: Path) -> None:
    stat, tick = tmp_path / "stat", os.sysconf("SC_CLK_TCK")
    _stat(stat, 1000, 1000)
    spare = Spare(stat)
    assert spare.free()  # no interval of LOOK_S yet: the first verdict (free) stands
    busy = 1000
    for loaded in (True, False, True):
        time.sleep(LOOK_S * 1.2)
        elapsed = LOOK_S * 1.2
        # another process busy on 1.5 cores, or only idle time passing (this process's own time is subtracted)
        busy += int((1.5 if loaded else 0.0) * elapsed * tick)
        _stat(stat, busy, 5000)
        assert spare.free() is (not loaded), (loaded, spare.others)
    assert Spare(tmp_path / "missing").free()  # no /proc/stat: every core counts as free
