"""The scheduler: which requests run this step, and how many tokens each brings.

The idea, written where it is used: every running request wants `num_tokens - num_computed_tokens` more
tokens computed (1 when decoding, the rest of its prompt when prefilling). Running requests are served
first, oldest first, each taking what it needs from the step's token budget (a long prompt takes a chunk
and continues next step: chunked prefill). Then waiting requests are admitted, oldest first, while the
budget, the running cap and the pool allow. When the pool runs out for a running request, the newest
running request is preempted: its computed prefix goes to the prefix cache (or back to the pool) and it
waits to be recomputed. Nothing crashes for lack of pages; a request that alone cannot fit fails cleanly.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from agentbox.config import EngineConfig
from agentbox.engine.kv_pool import PagePool
from agentbox.engine.prefix_cache import PrefixCache
from agentbox.engine.request import Request, Status


@dataclass
class ScheduledSeq:
    request: Request
    num_new_tokens: int
    sample: bool  # this chunk reaches the end of the request's tokens: sample one more


@dataclass
class SchedulerOutput:
    """The only contract between the scheduler and the runner."""

    seqs: list[ScheduledSeq]
    failed: list[Request]  # requests that can never fit the pool; finished with an error

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)


class Scheduler:
    def __init__(self, config: EngineConfig, pool: PagePool, cache: PrefixCache, max_model_len: int) -> None:
        self.config = config
        self.pool = pool
        self.cache = cache
        self.max_model_len = max_model_len
        self.page_size = pool.page_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # ---- lifecycle ----

    def add(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, req: Request, reason: str) -> None:
        """Finish (or abort) a request: its computed tokens go to the prefix cache, the rest of its pages back."""
        if req.is_finished:
            return
        if req.status is Status.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self._release_pages(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
        del self.requests[req.request_id]

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None:
            self.finish(req, "abort")
        return req

    def _release_pages(self, req: Request) -> None:
        # The last sampled token has no KV yet, so only computed tokens are cached, whole pages only.
        full = req.num_computed_tokens // self.page_size
        tokens = req.all_token_ids[: full * self.page_size]
        self.cache.insert(tokens, req.pages[:full], req.session_id)
        if len(req.pages) > full:
            self.pool.decref(req.pages[full:])
        req.pages = []
        req.num_computed_tokens = 0

    # ---- one step ----

    def _pages_for(self, req: Request, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size) - len(req.pages)

    def _reserve(self, req: Request, num_tokens: int) -> bool:
        need = self._pages_for(req, num_tokens)
        if need <= 0:
            return True
        if self.pool.num_free < need:
            self.cache.evict(need - self.pool.num_free)
        if self.pool.num_free < need:
            return False
        req.pages.extend(self.pool.alloc(need))
        return True

    def _preempt(self, victim: Request) -> None:
        self.running.remove(victim)
        self._release_pages(victim)
        victim.status = Status.WAITING
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)

    def _admit(self, req: Request) -> None:
        # Match at most num_tokens - 1 tokens: the last one must be computed to get logits to sample from.
        m = self.cache.match(req.all_token_ids[: req.num_tokens - 1], req.session_id)
        req.pages = m.pages
        req.num_computed_tokens = m.num_tokens
        req.cache_handle = m.handle
        if req.num_preemptions == 0:
            req.num_cached_tokens = m.num_tokens
            req.num_host_cached_tokens = m.num_host_tokens

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        seqs: list[ScheduledSeq] = []
        failed: list[Request] = []
        scheduled: set[str] = set()
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self._reserve(req, req.num_computed_tokens + n):
                victim = self.running[-1]
                if victim is req and len(self.running) == 1:
                    break
                self._preempt(victim)
                if victim is req:
                    break
            if req.status is not Status.RUNNING:
                continue  # req preempted itself; the list shifted
            if self._pages_for(req, req.num_computed_tokens + n) > 0:
                # Alone and still cannot fit: fail it rather than spin.
                failed.append(req)
                i += 1
                continue
            seqs.append(ScheduledSeq(req, n, req.num_computed_tokens + n == req.num_tokens))
            scheduled.add(req.request_id)
            budget -= n
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if self._pages_for(req, req.num_tokens) - 0 > self.pool.capacity:
                self.waiting.popleft()
                self.running.append(req)
                req.status = Status.RUNNING
                failed.append(req)
                continue
            self._admit(req)
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self._reserve(req, req.num_computed_tokens + n):
                self._release_pages(req)  # give the matched prefix back; try again next step
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            seqs.append(ScheduledSeq(req, n, req.num_computed_tokens + n == req.num_tokens))
            budget -= n
        return SchedulerOutput(seqs, failed)
