"""EngineConfig.prefill_join_tokens: once a prompt finishes in a step, other prompts add at most that many tokens
to it (the rest waits a step), while decodes still ride along; at or above the budget it changes nothing."""

from __future__ import annotations

from radix_harness import make_cache

from agentbox.config import EngineConfig
from agentbox.engine.cache.manager import CacheManager
from agentbox.engine.cache.rows import RowPool
from agentbox.engine.request import Request, Status
from agentbox.engine.sampling import SamplingParams
from agentbox.engine.scheduler import Scheduler, SchedulerOutput

PS = 2


def _scheduler(join: int) -> Scheduler:
    cache, _ = make_cache(num_pages=128, page_size=PS)
    cfg = EngineConfig(page_size=PS, max_num_batched_tokens=64, max_num_seqs=8, prefill_join_tokens=join,
                       cache_policy=cache.policy)
    return Scheduler(cfg, CacheManager(cache, RowPool(9)), max_model_len=128)


def _add(sch: Scheduler, rid: str, n: int) -> Request:
    req = Request(rid, [1000 * (ord(rid) - 96) + i for i in range(n)], SamplingParams(max_tokens=8), f"sess-{rid}")
    assert sch.add(req) is None
    return req


def _step(sch: Scheduler) -> dict[str, int]:
    """One step as the core runs it (a prompt that finishes samples its first token); {request: tokens}."""
    out: SchedulerOutput = sch.schedule()
    assert not out.failed
    for s in out.seqs:
        sch.computed(s.request, s.num_new_tokens)
        if s.sample:
            s.request.append_output(7)
    return {s.request.request_id: s.num_new_tokens for s in out.seqs}


def test_a_finishing_prompt_takes_only_join_tokens_of_the_next():
    sch = _scheduler(join=8)
    for rid in "abc":
        _add(sch, rid, 20)
    assert _step(sch) == {"a": 20, "b": 8}  # a finishes: b joins with 8 tokens, c waits
    assert _step(sch) == {"a": 1, "b": 12, "c": 8}  # a decodes alongside; b finishes, c joins with 8
    assert _step(sch) == {"a": 1, "b": 1, "c": 12}


def test_a_long_prompt_still_fills_the_budget():
    sch = _scheduler(join=8)
    _add(sch, "a", 100)
    _add(sch, "b", 20)
    assert _step(sch) == {"a": 64}  # a does not finish: the budget is its, as before
    assert _step(sch) == {"a": 36, "b": 8}


def test_join_at_the_budget_keeps_one_shared_step():
    sch = _scheduler(join=64)
    for rid in "abc":
        _add(sch, rid, 20)
    assert _step(sch) == {"a": 20, "b": 20, "c": 20}
    assert all(r.status is Status.RUNNING for r in sch.running)
