"""The radix cache over the GPU pool and the host tier: lookup and lock, refcounts, eviction order, sessions.

The requests and the cache come from radix_harness.py; the random-traffic state machine is in
test_radix_cache_machine.py.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from radix_harness import LAYERS, Clock, assert_holds, finish, make_cache, run_turn, start

from agentbox.engine.cache.kv_pool import PagePool
from agentbox.engine.cache.radix_cache import RadixCache, Tier
from agentbox.engine.cache.sessions import LeaseState
from agentbox.layers.backends.base import KVCache


def resident(cache: RadixCache) -> dict[int, Tier]:
    """First token of each top-level branch -> the tier of its deepest node (tests use 1-node branches)."""
    out = {}
    for n in cache.root.children.values():
        while n.children:
            n = next(iter(n.children.values()))
        out[n.key[0]] = n.tier
    return out


# ---- unit tests ----


def test_match_reuses_page_aligned_prefix_and_splits() -> None:
    cache, _ = make_cache(page_size=2)
    run_turn(cache, [1, 2, 3, 4, 5, 6, 7])  # 3 full pages cached, token 7 never
    assert cache.gpu_pages == 3
    m = cache.lock(cache.match([1, 2, 3, 4, 9, 9, 9]))
    assert m.num_tokens == 4 and len(m.pages) == 2 and m.num_copied_tokens == 0
    assert_holds(cache, [1, 2, 3, 4], m.pages, 4)
    assert all(cache.pool.refcount[p] == 2 for p in m.pages)
    cache.check_integrity(Counter(m.pages))
    cache.release(m.pages)
    m = cache.lock(cache.match([1, 2, 3]))
    assert m.num_tokens == 2  # the partial page is never matched
    cache.release(m.pages)
    cache.check_integrity(Counter())


def test_insert_of_existing_prefix_drops_the_duplicate_pages() -> None:
    cache, _ = make_cache(page_size=2)
    a, b = start(cache, [5, 5, 6, 6]), start(cache, [5, 5, 6, 6, 7, 7])  # computed concurrently
    assert a is not None and b is not None
    finish(cache, a)
    finish(cache, b)
    assert cache.gpu_pages == 3 and cache.pool.num_used == 3
    cache.check_integrity(Counter())


def test_policy_none_caches_nothing() -> None:
    cache, _ = make_cache(policy="none")
    run_turn(cache, [1, 2, 3, 4], "s")
    assert cache.match([1, 2, 3, 4], "s").num_tokens == 0
    assert cache.pool.num_used == 0 and cache.gpu_pages == 0


def test_running_requests_are_never_evicted() -> None:
    cache, _ = make_cache(num_pages=9, page_size=2)
    run_turn(cache, [1, 1, 1, 1])
    run_turn(cache, [2, 2, 2, 2])
    m = cache.lock(cache.match([1, 1, 1, 1]))
    assert cache.evict(100) == 2  # only the unheld branch
    assert resident(cache) == {1: Tier.GPU}
    cache.check_integrity(Counter(m.pages))
    cache.release(m.pages)
    assert cache.evict(100) == 2 and cache.gpu_pages == 0
    cache.check_integrity(Counter())


def _setup_classes(policy: str) -> tuple[RadixCache, Clock]:
    """Five branches, one 2-page node each, at t=20:
    1: untagged, used at t=1; 6: untagged, used at t=2 (class 0, LRU order 1 then 6)
    2: session e, lease expired at t=10 (class 1)
    3: session far, live, back in ~50 s; 4: session near, live, back any moment (class 2: far first)."""
    cache, clock = make_cache(num_pages=32, page_size=2, policy=policy)
    clock.t = 0.0
    run_turn(cache, [2] * 4, "e")  # lease to t=10
    for sid, gap in (("far", 50.0), ("near", 1.0)):
        cache.sessions.begin_turn(sid)
        cache.sessions.end_turn(sid)
        clock.t += gap
        cache.sessions.begin_turn(sid)  # one measured gap
        clock.t -= gap
    clock.t = 1.0
    run_turn(cache, [1] * 4)
    clock.t = 2.0
    run_turn(cache, [6] * 4)
    clock.t = 19.0
    run_turn(cache, [3] * 4, "far")
    run_turn(cache, [4] * 4, "near")
    clock.t = 20.0
    assert cache.sessions.lease_state("e") is LeaseState.EXPIRED
    assert cache.sessions.lease_state("far") is LeaseState.LIVE
    assert cache.sessions.lease_state("near") is LeaseState.LIVE
    return cache, clock


def _eviction_order(cache: RadixCache) -> list[int]:
    order = []
    while cache.gpu_pages:
        before = set(resident(cache))
        assert cache.evict(1) == 2
        order += sorted(before - set(resident(cache)))
        cache.check_integrity(Counter())
    return order


def test_eviction_order_by_class() -> None:
    cache, _ = _setup_classes("session")
    assert _eviction_order(cache) == [1, 6, 2, 3, 4]
    assert cache.evictions == 10


def test_lru_policy_ignores_leases() -> None:
    cache, _ = _setup_classes("lru")
    assert _eviction_order(cache) == [2, 1, 6, 3, 4]  # by last use only


def test_lease_expiry_moves_a_node_down_a_class() -> None:
    cache, clock = _setup_classes("session")
    clock.t = 500.0  # every lease has run out: all class 1 now, earliest expiry first
    order = _eviction_order(cache)
    assert order[:2] == [1, 6] and order[2] == 2


def test_host_tier_demotes_instead_of_dropping_and_promotes_back() -> None:
    cache, _ = make_cache(num_pages=5, page_size=2, host_pages=5)  # 4 usable pages each
    run_turn(cache, [1, 2, 3, 4, 5, 6], "a")
    run_turn(cache, [7, 7, 8, 8], "b")  # needs 2 pages: a's deepest page goes to host
    assert cache.demotions >= 1 and cache.host_pages >= 1
    cache.check_integrity(Counter())
    req = start(cache, [1, 2, 3, 4, 5, 6, 9], "a")
    assert req is not None
    assert cache.promotions >= 1
    assert_holds(cache, [1, 2, 3, 4, 5, 6], req.pages, 6)
    finish(cache, req)
    cache.check_integrity(Counter())
    m = cache.lock(cache.match([1, 2, 3, 4, 5, 6], "a"))
    assert m.num_tokens == 6 and m.num_copied_tokens == 0
    cache.release(m.pages)
    cache.check_integrity(Counter())


def test_promotion_reports_host_tokens() -> None:
    cache, _ = make_cache(num_pages=5, page_size=2, host_pages=9)
    run_turn(cache, [1, 1, 2, 2], "a")
    assert cache.demote(2) == 2 and cache.gpu_pages == 0 and cache.host_pages == 2
    assert cache.session_pages("a") == {Tier.GPU: 0, Tier.HOST: 2}
    m = cache.lock(cache.match([1, 1, 2, 2, 3], "a"))
    assert m.num_tokens == 4 and m.num_copied_tokens == 4 and cache.host_pages == 0
    assert cache.session_pages("a") == {Tier.GPU: 2, Tier.HOST: 0}
    assert_holds(cache, [1, 1, 2, 2], m.pages, 4)
    cache.check_integrity(Counter(m.pages))
    cache.release(m.pages)


def test_drop_session_keeps_shared_prefixes() -> None:
    cache, _ = make_cache(page_size=2)
    shared = [9, 9, 8, 8]
    run_turn(cache, shared + [1, 1, 1, 1], "a")
    run_turn(cache, shared + [2, 2], "b")
    assert cache.gpu_pages == 5
    assert cache.drop_session("a") == 2
    assert "a" not in cache.sessions and cache.gpu_pages == 3
    m = cache.lock(cache.match(shared + [2, 2], "b"))
    assert m.num_tokens == 6
    cache.release(m.pages)
    m = cache.lock(cache.match(shared + [1, 1], None))
    assert m.num_tokens == 4
    cache.release(m.pages)
    cache.check_integrity(Counter())


def test_drop_session_spares_held_nodes() -> None:
    cache, _ = make_cache(page_size=2)
    run_turn(cache, [1, 1, 2, 2], "a")
    m = cache.lock(cache.match([1, 1, 2, 2], "a"))
    assert cache.drop_session("a") == 0
    cache.check_integrity(Counter(m.pages))
    cache.release(m.pages)
    assert cache.evict(10) == 2  # now ordinary, unleased entries


def test_session_inference_follows_the_producing_session() -> None:
    cache, _ = make_cache(page_size=2)
    system = [7, 7, 7, 7]
    conversations = {"A": system + [1, 1], "B": system + [2, 2], "C": system + [3, 3]}
    for sid, prompt in conversations.items():
        cache.sessions.begin_turn(sid)
        m = cache.lock(cache.match(prompt, sid))
        cache.sessions.record_prompt(sid, prompt, m.num_tokens, m.num_copied_tokens, cache.ps)
        cache.release(m.pages)
        run_turn(cache, prompt + [ord(sid) % 5] * 2, sid)  # prompt + "generated"
    for sid, prompt in conversations.items():
        m = cache.match(prompt + [ord(sid) % 5] * 2 + [0] * 4, None)  # the next turn re-sends it all, no key
        assert m.session == sid
    fresh = cache.match(system + [4, 4], None)  # a new conversation sharing only the system prompt
    assert fresh.session is None and fresh.num_tokens == 4
    assert cache.match([5, 5], None).session is None
    cache.check_integrity(Counter())


def test_lease_cap_releases_the_oldest_leases() -> None:
    cache, clock = make_cache(num_pages=11, page_size=2, max_share=0.5)  # cap: 5 pages
    run_turn(cache, [1] * 8, "old")
    clock.t = 1.0
    assert cache.stats().leased_pages == 4
    run_turn(cache, [2] * 6, "new")
    assert cache.sessions.lease_state("old") is LeaseState.NONE
    assert cache.sessions.lease_state("new") is LeaseState.LIVE
    assert cache.stats().leased_pages == 3
    cache.evict(1)
    assert resident(cache) == {2: Tier.GPU}  # the released lease went first
    cache.check_integrity(Counter())


def test_hit_refreshes_the_lease() -> None:
    cache, clock = make_cache(page_size=2)
    run_turn(cache, [1, 1, 2, 2], "s")
    clock.t = 9.0
    assert cache.sessions.lease_state("s") is LeaseState.LIVE
    cache.release(cache.lock(cache.match([1, 1, 2, 2], "s")).pages)
    clock.t = 15.0  # past the first TTL, within the refreshed one
    assert cache.sessions.lease_state("s") is LeaseState.LIVE
    clock.t = 19.5
    assert cache.sessions.lease_state("s") is LeaseState.EXPIRED


def test_recomputed_history_is_counted() -> None:
    cache, _ = make_cache(num_pages=9, page_size=2)
    prompt = [1, 1, 2, 2, 3]
    cache.sessions.begin_turn("s")
    m = cache.lock(cache.match(prompt, "s"))
    assert cache.sessions.record_prompt("s", prompt, m.num_tokens, m.num_copied_tokens, cache.ps) == 0
    cache.release(m.pages)
    run_turn(cache, prompt + [4, 4, 4], "s")
    cache.evict(100)  # history lost
    nxt = prompt + [4, 4, 4, 5, 5]
    cache.sessions.begin_turn("s")
    m = cache.lock(cache.match(nxt, "s"))
    assert m.num_tokens == 0
    assert cache.sessions.record_prompt("s", nxt, m.num_tokens, m.num_copied_tokens, cache.ps) == 8
    cache.release(m.pages)
    assert cache.sessions.get("s").recomputed_tokens == 8  # type: ignore[union-attr]


def test_stale_heap_entries_are_compacted() -> None:
    cache, clock = make_cache(num_pages=9, page_size=2)
    run_turn(cache, [1, 1, 2, 2], "s")
    for _ in range(500):  # every hit re-pushes the leaf and refreshes the lease; nothing is evicted
        clock.t += 0.01
        cache.release(cache.lock(cache.match([1, 1, 2, 2], "s")).pages)
    assert len(cache._gpu_heap) <= 4 * cache.gpu_pages + 65
    assert cache.index.num_expiry_entries() <= 4 * len(cache.sessions) + 65
    cache.check_integrity(Counter())
    assert cache.evict(2) == 2


def test_from_config_builds_the_host_tier_for_the_session_policy() -> None:
    from agentbox.config import EngineConfig
    from agentbox.engine.cache.cache_policies import kv_manager

    kv = KVCache.uniform(LAYERS, 8, 4, 1, 2, torch.float32, "cpu")
    per_page = 2 * LAYERS * 4 * 2 * 4
    for policy, has_host in (("session", True), ("lru", False), ("none", False)):
        cfg = EngineConfig(cache_policy=policy, host_cache_gb=6 * per_page / 1024**3, lease_max_share=0.5)
        cache = kv_manager(cfg, PagePool(8, 4), kv)
        assert (cache.host is not None) == has_host and cache.policy == policy
        assert cache.sessions.max_share == 0.5
        if cache.host is not None:
            assert cache.host.pool.num_pages == 6


def test_insert_rejects_too_few_pages() -> None:
    cache, _ = make_cache()
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3, 4], [1], None)
