"""A tiny radix cache over a CPU pool, and requests driven through it the way the scheduler does.

Page contents are written as a function of (token, position, layer), so every lock also proves that the
pages it returns (including ones demoted to host and promoted back) hold that prefix's k/v. `snapshot` is
everything observable about a cache, to prove that a lookup (or an admission that declines) changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from agentbox.config import CachePolicy
from agentbox.engine.cache.cache_policies import cache_for
from agentbox.engine.cache.host_tier import HostTier
from agentbox.engine.cache.kv_pool import PagePool
from agentbox.engine.cache.kv_pool import PagePool as _Pool
from agentbox.engine.cache.radix_cache import RadixCache
from agentbox.engine.cache.radix_node import Lock, Node
from agentbox.engine.cache.sessions import SessionTable
from agentbox.layers.backends.base import KVCache

LAYERS = 2


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _value(token: int, pos: int, layer: int) -> float:
    return float(token * 1000 + pos * 10 + layer)


def make_cache(
    num_pages: int = 16,
    page_size: int = 2,
    host_pages: int = 0,
    policy: CachePolicy | str = CachePolicy.SESSION,
    max_share: float = 1.0,
    clock: Clock | None = None,
) -> tuple[RadixCache, Clock]:
    clock = clock or Clock()
    pool = PagePool(num_pages, page_size)
    kv = KVCache.uniform(LAYERS, num_pages, page_size, 1, 1, torch.float32, "cpu")
    host = HostTier.like(kv, host_pages) if host_pages else None
    sessions = SessionTable(default_ttl_s=10.0, max_ttl_s=120.0, max_share=max_share, clock=clock)
    return cache_for(CachePolicy(policy), pool, kv, sessions, host), clock


def compute(cache: RadixCache, tokens: list[int], pages: list[int], start: int) -> None:
    """What the model would do: write k/v of tokens[start:] into the request's pages."""
    assert cache.kv is not None
    ps = cache.ps
    for pos in range(start, len(tokens)):
        slot = pages[pos // ps] * ps + pos % ps
        for layer in range(LAYERS):
            cache.kv.k[layer][slot] = _value(tokens[pos], pos, layer)
            cache.kv.v[layer][slot] = -_value(tokens[pos], pos, layer)


def assert_holds(cache: RadixCache, tokens: list[int], pages: list[int], n: int) -> None:
    assert cache.kv is not None
    ps = cache.ps
    for pos in range(n):
        slot = pages[pos // ps] * ps + pos % ps
        for layer in range(LAYERS):
            assert cache.kv.k[layer][slot].item() == _value(tokens[pos], pos, layer), (pos, layer)
            assert cache.kv.v[layer][slot].item() == -_value(tokens[pos], pos, layer), (pos, layer)


@dataclass
class Req:
    tokens: list[int]
    session: str | None
    pages: list[int] = field(default_factory=list)


def start(cache: RadixCache, tokens: list[int], session: str | None = None) -> Req | None:
    """Admit a request the way the scheduler does: look up, check the room (pure), and only then lock,
    allocate the rest (evicting) and compute. A request that does not fit leaves the cache as it was."""
    m = cache.match(tokens, session)
    need = -(-len(tokens) // cache.ps) - m.num_resident_tokens // cache.ps
    if need > cache.reclaimable(m):
        return None
    lock = cache.lock(m)
    check_lock(cache, tokens, lock)
    assert lock.num_tokens == m.num_tokens  # the room was there, so every host part was promoted
    rest = -(-len(tokens) // cache.ps) - len(lock.pages)
    if cache.pool.num_free < rest:
        cache.evict(rest - cache.pool.num_free)
    assert cache.pool.num_free >= rest, "reclaimable promised more than eviction freed"
    req = Req(tokens, lock.session, lock.pages + cache.pool.alloc(rest))
    compute(cache, tokens, req.pages, lock.num_tokens)
    return req


def check_lock(cache: RadixCache, tokens: list[int], lock: Lock) -> None:
    assert lock.num_tokens == len(lock.pages) * cache.ps <= len(tokens)
    assert_holds(cache, tokens, lock.pages, lock.num_tokens)
    assert all(cache.pool.refcount[p] >= 2 for p in lock.pages)  # the tree's and the caller's


def finish(cache: RadixCache, req: Req) -> None:
    full = len(req.tokens) // cache.ps
    cache.insert(req.tokens, req.pages[:full], req.session)
    cache.pool.decref(req.pages[full:])
    if req.session is not None:
        cache.end_turn(req.session)


def run_turn(cache: RadixCache, tokens: list[int], session: str | None = None) -> None:
    req = start(cache, tokens, session)
    assert req is not None
    finish(cache, req)


def _pool_state(pool: _Pool) -> tuple[Any, ...]:
    return (list(pool.refcount), list(pool._free), pool.num_shared)


def _node_state(n: Node) -> tuple[Any, ...]:
    return (n.key, tuple(n.pages), n.tier, tuple(sorted(n.sessions)), n.start, n.last_access, n.version, n.alive)


def snapshot(cache: RadixCache) -> dict[str, Any]:
    """Everything observable about the cache: tree, pools, k/v bytes, heaps, tags, leases, session counters."""
    tree: list[tuple[Any, ...]] = []
    stack = [cache.root]
    while stack:
        n = stack.pop()
        tree.append(_node_state(n))
        stack.extend(n.children[k] for k in sorted(n.children, reverse=True))
    kv = [t.clone() for t in (*cache.kv.k, *cache.kv.v)] if cache.kv is not None else []
    if cache.host is not None:
        kv += [t.clone() for t in (*cache.host.kv.k, *cache.host.kv.v)]
    sessions = {}
    for s in cache.sessions:
        d = dict(vars(s))
        d["gaps"], d["turn_history"] = list(s.gaps), list(s.turn_history)
        sessions[s.id] = d
    return {
        "tree": tree,
        "gpu_pool": _pool_state(cache.pool),
        "host_pool": _pool_state(cache.host.pool) if cache.host is not None else None,
        "kv": [t.numpy().tobytes() for t in kv],
        "heaps": [[(e[0], e[1], e[2], id(e[3])) for e in h] for h in (cache._gpu_heap, cache._host_heap)],
        "tags": {sid: sorted(id(n) for n in nodes) for sid, nodes in cache.index.nodes.items()},
        "expiries": list(cache.index._expiries),
        "sessions": sessions,
        "counters": (cache.gpu_pages, cache.host_pages, cache.evictions, cache.demotions, cache.promotions,
                     cache.host_evictions, cache._epoch),
    }
