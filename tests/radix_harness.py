"""A tiny radix cache over a CPU pool, and requests driven through it the way the scheduler does.

Page contents are written as a function of (token, position, layer), so every match also proves that the
pages it returns (including ones demoted to host and promoted back) hold that prefix's k/v.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from agentbox.engine.host_tier import HostTier
from agentbox.engine.kv_pool import PagePool
from agentbox.engine.radix_cache import RadixCache
from agentbox.engine.sessions import SessionTable
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
    policy: str = "session",
    max_share: float = 1.0,
    clock: Clock | None = None,
) -> tuple[RadixCache, Clock]:
    clock = clock or Clock()
    pool = PagePool(num_pages, page_size)
    kv = KVCache(LAYERS, num_pages, page_size, 1, 1, torch.float32, "cpu")
    host = HostTier.like(kv, host_pages) if host_pages else None
    sessions = SessionTable(default_ttl_s=10.0, max_ttl_s=120.0, max_share=max_share, clock=clock)
    return RadixCache(pool, kv, sessions, host, policy), clock


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
    """Admit a request the way the scheduler does: match, allocate the rest (evicting), compute."""
    m = cache.match(tokens, session)
    assert m.num_tokens == len(m.pages) * cache.ps <= len(tokens)
    assert_holds(cache, tokens, m.pages, m.num_tokens)
    need = -(-len(tokens) // cache.ps) - len(m.pages)
    if cache.pool.num_free < need:
        cache.evict(need - cache.pool.num_free)
    if cache.pool.num_free < need:
        cache.release(m.pages)
        return None
    req = Req(tokens, m.session, m.pages + cache.pool.alloc(need))
    compute(cache, tokens, req.pages, m.num_tokens)
    return req


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
