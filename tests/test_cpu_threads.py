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


def test_a_step_takes_every_core_only_while_they_are_spare(smollm2_loaded, smollm2_path, tmp_path: Path) -> None:  # noqa: ANN001
    """Unset cpu_threads: every core while other processes leave them free, the engine's count when they do not;
    an explicit cpu_threads is kept either way."""
    import torch

    from agentbox.config import EngineConfig
    from agentbox.engine.exec.cpu_threads import step_threads
    from agentbox.engine.llm import LLM

    idle = Spare(tmp_path / "missing")
    stat, tick = tmp_path / "stat", os.sysconf("SC_CLK_TCK")
    _stat(stat, 1000, 1000)
    busy = Spare(stat)
    time.sleep(LOOK_S * 1.2)
    _stat(stat, 1000 + int(2 * LOOK_S * 1.2 * tick), 1000)  # others on two cores
    assert not busy.free()
    for threads in (None, 1):
        llm = LLM(EngineConfig(model=str(smollm2_path), num_pages=64, cpu_threads=threads), loaded=smollm2_loaded)
        try:
            runner, cores = llm.core.runner, os.cpu_count() or 1
            every = cores if threads is None and cores > torch.get_num_threads() else None
            assert step_threads(runner.device, runner.config.cpu_threads, runner.tp, idle) == every
            assert step_threads(runner.device, runner.config.cpu_threads, runner.tp, busy) is None
        finally:
            llm.close()


def test_the_lm_head_runs_on_the_steps_cores(smollm2_loaded, smollm2_path, tmp_path: Path) -> None:  # noqa: ANN001
    """The LM head is a decode step's largest matrix; it ran on the engine's one thread while the layers took
    both cores (the hybrid's one-session agent replay: 13.4 s, 12.1 s with the head on the step's cores)."""
    import torch

    from agentbox.config import EngineConfig
    from agentbox.engine.llm import LLM
    from agentbox.engine.sampling import SamplingParams

    llm = LLM(EngineConfig(model=str(smollm2_path), num_pages=64), loaded=smollm2_loaded)
    model = smollm2_loaded.model
    seen: list[int] = []
    head = model.compute_logits
    try:
        runner, cores = llm.core.runner, os.cpu_count() or 1
        runner.spare = Spare(tmp_path / "missing")  # every core free
        model.compute_logits = lambda hidden: (seen.append(torch.get_num_threads()), head(hidden))[1]
        llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        assert seen and set(seen) == {max(cores, torch.get_num_threads())}, (seen, cores)
    finally:
        model.__dict__.pop("compute_logits", None)
        llm.close()
