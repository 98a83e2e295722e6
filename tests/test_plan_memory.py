"""The plan's memory is what the server takes (on CPU the KV pool is the plan's context x sessions, with no
host tier copying it within the same RAM), and a CPU plan is stable for a machine: free RAM moves the chosen
variant only when that variant cannot load now, and then the plan says why."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from agentbox.config import PLAN_CONTEXT, EngineConfig
from agentbox.hub.plan import plan
from agentbox.hub.profiles import find_profile
from agentbox.hw.hardware import load_hardware
from agentbox.hw.probe import GIB, Probe


def _cpu(total_gib: float, free_gib: float) -> Probe:
    p = load_hardware("cpu")
    p.host = replace(p.host, ram_total=int(total_gib * GIB), ram_free=int(free_gib * GIB))
    return p


def test_a_cpu_plan_does_not_move_with_free_ram_unless_it_must() -> None:
    qwen = find_profile("Qwen3-8B")
    at_rest = plan(qwen, _cpu(64, 60))
    assert at_rest.chosen is not None
    best = at_rest.chosen.variant.name
    need = at_rest.chosen.need_per_device / GIB
    # Free RAM anywhere above what the chosen variant needs: the same plan, no note about it.
    for free in (need + 0.5, need + 10, 63):
        p = plan(qwen, _cpu(64, free))
        assert p.chosen is not None and p.chosen.variant.name == best
        assert not any("free now" in n for n in p.notes)
    # Below it, the plan moves to the next variant that loads now, and says why.
    machine = _cpu(64, need - 1)
    short = plan(qwen, machine)
    assert short.chosen is not None and short.chosen.variant.name != best
    (note,) = [n for n in short.notes if "free now" in n]
    assert note.startswith(f"{best} is the plan for this machine's RAM but needs {need:.1f} GiB")
    assert f"chose {short.chosen.variant.name} instead (free memory to get {best} back)" in note
    rejected = next(c for c in short.candidates if c.variant.name == best)
    assert rejected.reasons == [
        f"fits this machine's RAM but not what is free now: needs {need:.1f} GiB, "
        f"{machine.host.ram_free / GIB:.1f} GiB free now"]


def test_the_cpu_kv_pool_is_what_the_plan_counted(smollm2_path: Path, smollm2_fast: object) -> None:
    from agentbox.engine.llm import LLM

    cand = next(c for c in plan(find_profile("SmolLM2-135M-Instruct"), load_hardware("cpu")).candidates
                if c.variant.name == "embedded")
    with LLM(EngineConfig(model=str(smollm2_path)), loaded=smollm2_fast) as llm:  # type: ignore[arg-type]
        runner = llm.core.runner
        page_bytes = runner.kv_cache.page_bytes
        # Page 0 is the pool's null page. The plan counts one 8,192-token context; the pool holds the plan's
        # 32,768 tokens (PLAN_CONTEXT: several such sessions resident) where RAM has twice that to spare, as here.
        assert (runner.num_pages - 1) * page_bytes == cand.kv_bytes * PLAN_CONTEXT // 8192
        assert runner.max_model_len == 8192
        assert llm.core.cache.page_cache.host is None  # on CPU a host tier would copy within the same RAM
