"""Look up, then lock: the radix cache's lookup is pure, locking is a separate step, and an admission that
does not fit leaves the cache byte for byte as it was (tree, pages, refcounts, k/v, tags, leases, heaps).

The cache comes from radix_harness.py; the scheduler runs over it with real requests and no model."""

from __future__ import annotations

from collections import Counter

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, event, given, settings
from radix_harness import Clock, check_lock, make_cache, run_turn, snapshot

from agentbox.config import EngineConfig
from agentbox.engine.cache.manager import CacheManager
from agentbox.engine.cache.radix_cache import RadixCache, Tier
from agentbox.engine.cache.rows import RowPool
from agentbox.engine.cache.sessions import LeaseState
from agentbox.engine.request import Request, Status
from agentbox.engine.sampling import SamplingParams
from agentbox.engine.scheduler import Scheduler


def _mixed_cache() -> tuple[RadixCache, Clock]:
    """Two sessions on a page-size-2 tree: a's 3-page branch on GPU, b's 2-page branch on host, live leases."""
    cache, clock = make_cache(num_pages=9, page_size=2, host_pages=9)
    run_turn(cache, [7, 7, 1, 1, 1, 1], "a")
    clock.t = 1.0
    run_turn(cache, [7, 7, 2, 2, 2, 2], "b")
    assert cache.demote(2) == 2  # b's private pages go to host (b is expected back later than a)
    assert cache.session_pages("b") == {Tier.GPU: 1, Tier.HOST: 2}
    clock.t = 3.0
    return cache, clock


def test_lookup_has_no_side_effects() -> None:
    cache, _ = _mixed_cache()
    before = snapshot(cache)
    for tokens, session in (
        ([7, 7, 1, 1, 1, 1, 5], "a"),  # whole GPU branch
        ([7, 7, 1, 1, 9, 9], "a"),  # ends inside a node: a lock would split it
        ([7, 7, 2, 2, 2, 2, 5], "b"),  # a host part: a lock would promote it
        ([7, 7, 2, 2, 2, 2, 5], None),  # no key: the session is inferred
        ([7, 7, 2, 2, 2, 2], "new"),  # an unknown session: a lock would create it
        ([3, 3, 3], None),
    ):
        m = cache.match(tokens, session)
        cache.reclaimable(m)
        assert snapshot(cache) == before
    m = cache.match([7, 7, 2, 2, 2, 2, 5], None)
    assert (m.num_tokens, m.num_copied_tokens, m.session) == (6, 4, "b")
    assert cache.match([7, 7, 1, 1, 9, 9], "a").num_tokens == 4
    assert cache.promotions == 0 and "new" not in cache.sessions


def test_lock_commits_what_the_lookup_found() -> None:
    cache, _ = _mixed_cache()
    expiry = cache.sessions.get("b").lease_expiry  # type: ignore[union-attr]
    m = cache.match([7, 7, 2, 2, 2, 2, 5], None)
    lock = cache.lock(m)
    check_lock(cache, [7, 7, 2, 2, 2, 2], lock)
    assert (lock.num_tokens, lock.num_copied_tokens, lock.session) == (6, 4, "b")
    assert cache.promotions == 2 and cache.session_pages("b") == {Tier.GPU: 3, Tier.HOST: 0}
    assert cache.sessions.get("b").lease_expiry > expiry  # type: ignore[union-attr]  # refreshed at t=3
    cache.check_integrity(Counter(lock.pages))
    # A lock ending inside a node splits it there, so references cover whole nodes.
    part = cache.lock(cache.match([7, 7, 1, 1, 9, 9], "c"))
    assert part.num_tokens == 4 and cache.gpu_pages == 5
    assert cache.root.children[(7, 7)].children[(1, 1)].key == (1, 1)  # cut after the matched page
    assert "c" in cache.sessions and cache.sessions.lease_state("c") is LeaseState.LIVE
    cache.check_integrity(Counter(lock.pages + part.pages))
    cache.release(lock.pages + part.pages)
    cache.check_integrity(Counter())


def test_a_lookup_the_tree_changed_under_is_refused() -> None:
    cache, _ = _mixed_cache()
    m = cache.match([7, 7, 1, 1, 1, 1], "a")
    run_turn(cache, [8, 8, 8, 8], "c")  # new nodes
    with pytest.raises(ValueError, match="stale"):
        cache.lock(m)
    with pytest.raises(ValueError, match="stale"):
        cache.reclaimable(m)
    m = cache.match([7, 7, 1, 1, 1, 1], "a")
    cache.evict(0)  # asks for nothing, changes nothing: the lookup stays good
    cache.release(cache.lock(m).pages)
    cache.check_integrity(Counter())


def test_reclaimable_leaves_out_locked_pages_and_the_match() -> None:
    cache, _ = make_cache(num_pages=11, page_size=2)  # 10 usable pages
    run_turn(cache, [1, 1, 1, 1, 1, 1], "a")  # 3 pages
    run_turn(cache, [2, 2, 2, 2], "b")  # 2 pages
    assert cache.pool.num_free == 5
    held = cache.lock(cache.match([2, 2, 2, 2], "b"))  # b's branch is in use now
    m = cache.match([1, 1, 1, 1, 3, 3], "a")  # 2 of a's 3 pages
    assert cache.reclaimable(m) == 5 + 1  # free, plus a's last page; not b's (locked), not m's own two
    assert cache.reclaimable(cache.match([9, 9], None)) == 5 + 3
    cache.release(held.pages)
    assert cache.reclaimable(cache.match([9, 9], None)) == 5 + 5


# ---- admission in the scheduler: look, check, and only then lock ----

PS = 2


def _scheduler(cache: RadixCache, max_num_seqs: int = 8) -> Scheduler:
    cfg = EngineConfig(page_size=PS, max_num_batched_tokens=64, max_num_seqs=max_num_seqs, cache_policy=cache.policy)
    return Scheduler(cfg, CacheManager(cache, RowPool(max_num_seqs + 1)), max_model_len=64)


def running_refs(sch: Scheduler) -> Counter[int]:
    """The references the running requests hold, by page."""
    return Counter(p for h in sch.handles() for p in h.pages)


def _running(sch: Scheduler, rid: str, num_tokens: int) -> Request:
    """A request that already runs with all its pages (its prompt is being computed)."""
    req = Request(rid, [100 + i for i in range(num_tokens)], SamplingParams(max_tokens=4), f"sess-{rid}")
    lock = sch.cache.lock(sch.cache.match([]), req.all_token_ids)  # nothing cached: a row and no pages
    assert sch.cache.grow(lock.handle, num_tokens)
    req.cache_handle = lock.handle
    req.status = Status.RUNNING
    sch.running.append(req)
    sch.requests[rid] = req
    return req


def test_a_declined_admission_leaves_the_cache_unchanged_and_counts_the_one_that_ran() -> None:
    cache, _ = make_cache(num_pages=9, page_size=PS, host_pages=9)  # 8 usable GPU pages
    history = [5] * 8
    run_turn(cache, history, "B")
    assert cache.demote(8) == 4 and cache.gpu_pages == 0  # B's history waits on host
    sch = _scheduler(cache)
    a = _running(sch, "a", 14)  # 7 of the 8 pages
    b2 = Request("b2", history + [6] * 4, SamplingParams(max_tokens=2), "B")
    assert sch.add(b2) is None and b2 in sch.waiting  # a returning session
    turns = cache.sessions.get("B").turns  # type: ignore[union-attr]
    before = snapshot(cache)
    out = sch.schedule()
    # B needs 6 pages (4 to promote its history into, 2 for its question); 1 is free and nothing is
    # reclaimable: it waits, and nothing about the cache moved (no promotion, tag, lease refresh, split).
    assert [s.request for s in out.seqs] == [a] and b2.status is Status.WAITING and b2.cache_handle is None
    assert snapshot(cache) == before
    assert cache.sessions.get("B").turns == turns  # type: ignore[union-attr]  # its turn has not begun
    sch.finish(a, "stop")
    out = sch.schedule()
    assert [s.request for s in out.seqs] == [b2] and b2.status is Status.RUNNING
    # The counters come from the admission that ran: the whole history, copied back from host.
    assert (b2.num_cached_tokens, b2.num_host_cached_tokens, b2.num_recomputed_tokens) == (8, 8, 0)
    assert cache.promotions == 4 and cache.sessions.get("B").turns == turns + 1  # type: ignore[union-attr]
    cache.check_integrity(running_refs(sch))
    # A preemption and a return re-lock the prefix but neither recount nor begin another turn.
    b2.num_computed_tokens = b2.num_tokens
    sch._preempt(b2)
    sch.schedule()
    assert b2.status is Status.RUNNING and b2.num_preemptions == 1
    assert (b2.num_cached_tokens, b2.num_host_cached_tokens) == (8, 8)
    assert cache.sessions.get("B").turns == turns + 1  # type: ignore[union-attr]
    sch.finish(b2, "stop")
    cache.check_integrity(Counter())


def test_a_keyless_request_gets_its_session_when_admitted() -> None:
    # lru: no new-session gate in front, so the page check is what declines the first attempt.
    cache, _ = make_cache(num_pages=17, page_size=PS, policy="lru")
    prompt = [4, 4, 5, 5, 6, 6]
    run_turn(cache, prompt + [7, 7], "agent")  # 4 pages in the tree
    sch = _scheduler(cache)
    blocker = _running(sch, "x", 22)  # 11 pages: 1 left free
    req = Request("r", prompt + [7, 7, 8, 8, 9], SamplingParams(max_tokens=2), None)
    sch.add(req)
    before = snapshot(cache)
    sch.schedule()  # it needs 2 pages beyond its 4 cached ones
    assert req.status is Status.WAITING and req.session_id is None and snapshot(cache) == before
    sch.finish(blocker, "stop")
    sch.schedule()
    assert req.session_id == "agent" and req.num_cached_tokens == 8
    sch.finish(req, "stop")
    cache.check_integrity(Counter())


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_scheduler_admission_under_random_traffic(data: st.DataObject) -> None:
    """Agents' turns (each re-sends its session's last prompt plus new tokens) through the scheduler over a
    small pool and host tier: an admission either fits (its reservation never fails: reclaimable was right)
    or changes nothing, and the pools stay consistent after every step. The 'model' computes nothing and
    answers at once, so only prompts exercise the cache."""
    ps = data.draw(st.sampled_from([2, 4]), "page size")
    gpu = data.draw(st.integers(6, 16), "gpu pages")
    policy = data.draw(st.sampled_from(["session", "session", "lru", "none"]), "policy")
    host = data.draw(st.sampled_from([0, 6, 24]), "host pages") if policy == "session" else 0
    cache, clock = make_cache(gpu, ps, host, policy)
    cfg = EngineConfig(page_size=ps, max_num_batched_tokens=data.draw(st.integers(2, 12), "budget"),
                       max_num_seqs=data.draw(st.integers(2, 4), "max seqs"), cache_policy=policy,
                       admission_timeout_s=1e9)
    max_len = (gpu - 1) * ps
    sch = Scheduler(cfg, CacheManager(cache, RowPool(cfg.max_num_seqs)), max_model_len=max_len)
    last: dict[str, list[int]] = {}
    arrivals = data.draw(st.lists(st.tuples(st.sampled_from([None, "a", "b", "c"]),
                                            st.lists(st.integers(0, 3), min_size=1, max_size=8)),
                                  min_size=1, max_size=16), "turns")
    pending = list(enumerate(arrivals))
    declined = 0
    for _ in range(500):
        if pending and data.draw(st.booleans(), "arrive now"):
            i, (sid, new) = pending.pop(0)
            prompt = (last.get(sid, []) if sid else []) + new
            prompt = prompt[-(max_len - 1):]
            if sid:
                last[sid] = prompt
            sch.add(Request(f"r{i}", prompt, SamplingParams(max_tokens=1), sid))
        heads = [q[0] for q in (sch.waiting, sch.waiting_new) if q]
        out = sch.schedule()  # raises if an admission's reservation fails after its check passed
        room = len(sch.running) < cfg.max_num_seqs and out.num_tokens < cfg.max_num_batched_tokens
        declined += room and any(r.status is Status.WAITING for r in heads)
        for req, _code, _why in out.failed:
            sch.finish(req, "error")
        for s in out.seqs:
            s.request.num_computed_tokens += s.num_new_tokens
            if s.sample:
                sch.finish(s.request, "length")
        cache.check_integrity(running_refs(sch))
        clock.t += 0.25
        if not pending and not sch.has_work():
            break
    assert not sch.has_work()
    cache.check_integrity(Counter())
    event(f"declined={declined > 0} promoted={cache.promotions > 0}")
