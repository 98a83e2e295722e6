"""The scheduler: which requests run this step, and how many tokens each brings.

The idea, written where it is used: every running request wants `num_tokens - num_computed_tokens` more
tokens computed (1 when decoding, the rest of its prompt when prefilling). Running requests are served
first, oldest first, each taking what it needs from the step's token budget (a long prompt takes a chunk
and continues next step: chunked prefill; once a prompt finishes in a step, other prompts add at most
prefill_join_tokens to it, see _Budget). Then waiting requests are admitted while the budget, the
running cap and the pool allow: first requests of sessions coming back from a tool (and preempted ones),
then requests that start a new session. A new session is admitted only while running work plus the
sessions' leased working sets leave room for its prompt; otherwise it waits (FIFO, bounded), and past the
admission timeout it is refused (the API answers 429 with Retry-After). Leases stay soft: a running request
that needs pages breaks them through the cache's eviction order.

Admission looks before it takes: a pure cache lookup (the cache decides how far a prefix can be resumed, for
every group of the model's layout), then a pure check that the pages the request needs (its first chunk alone,
or its whole prompt beside the running requests' remaining prompts) are free or reclaimable without touching its
match; only then the lock (references, copies from slower tiers, session tag, lease, row, state seed) and the
reservation. Everything cached is the cache's (engine/cache/manager.py): a request holds its handle, and the
scheduler never looks inside. A request that does not fit leaves the cache exactly as it was. When the pool runs out for a running
request, the newest running request is preempted: its computed prefix goes to the prefix cache and it
waits to be recomputed (mostly from that cache). Nothing crashes for lack of pages.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from agentbox import collector
from agentbox.config import EngineConfig
from agentbox.engine.cache.manager import CacheManager, Lock, Match, SeqCache
from agentbox.engine.draft import Drafter
from agentbox.engine.request import Request, Status


@dataclass
class ScheduledSeq:
    request: Request
    num_new_tokens: int
    sample: bool  # this chunk reaches the end of the request's tokens: sample one more
    # Speculative decoding: tokens proposed after the request's last one, scored in this step after it (they
    # count in num_new_tokens and have KV slots reserved); the sampler keeps the prefix the model agrees with.
    draft: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    """The only contract between the scheduler and the runner."""

    seqs: list[ScheduledSeq]
    failed: list[tuple[Request, str, str]]  # (request, error code, message): finished with an error
    state_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) state slots, before the step

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)


class _Budget:
    """A step's tokens, and what other prompts may still add once a prompt finishes in it
    (EngineConfig.prefill_join_tokens). A step's prompts finish together: a 650-token turn sharing its step with the
    next turn's 374 tokens got its first token as late as that turn, which then still had tokens to go. Held to
    `join`, the next turn's chunk moves to the following step; the total work, and so that turn's own first token,
    stays where it was. Decodes are not held."""

    def __init__(self, tokens: int, join: int) -> None:
        self.tokens = tokens
        self.join = join
        self.rest: int | None = None  # None until a prompt finishes in the step

    def left(self, prompt: bool) -> int:
        return self.tokens if not prompt or self.rest is None else min(self.tokens, self.rest)

    def took(self, n: int, prompt: bool, finishes: bool) -> None:
        """n tokens joined the step; `prompt`: a prompt's chunk, `finishes`: it completes its prompt."""
        self.tokens -= n
        if prompt and self.rest is not None:
            self.rest -= n
        elif prompt and finishes:
            self.rest = self.join


def _handle(req: Request) -> SeqCache:
    h = req.cache_handle
    if h is None:
        raise RuntimeError(f"request {req.request_id} runs without a cache handle")
    return h


class Scheduler:
    def __init__(self, config: EngineConfig, cache: CacheManager, max_model_len: int,
                 drafter: Drafter | None = None) -> None:
        self.config = config
        self.cache = cache
        self.max_model_len = max_model_len
        self.page_size = cache.page_size
        self.drafter = drafter  # speculative decoding, when on
        self.waiting: deque[Request] = deque()  # returning sessions and preempted requests
        self.waiting_new: deque[Request] = deque()  # requests that start a new session
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.admission_timeouts = 0
        self.admission_rejections = 0

    # ---- lifecycle ----

    def add(self, req: Request) -> str | None:
        """Queues a request; returns an error code when the admission queue is full."""
        if self.cache.gates_new_sessions and not self.cache.knows(req.session_id):
            if len(self.waiting_new) >= self.config.admission_queue_size:
                self.admission_rejections += 1
                return "queue_full"
            self.waiting_new.append(req)
        else:
            self.waiting.append(req)
        self.requests[req.request_id] = req
        return None

    def has_work(self) -> bool:
        return bool(self.waiting or self.waiting_new or self.running)

    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.waiting_new)

    def finish(self, req: Request, reason: str) -> None:
        """Finish (or abort) a request: its computed tokens go to the prefix cache, the rest of its pages back."""
        if req.is_finished:
            return
        began = req.status is Status.RUNNING or req.num_preemptions > 0  # admitted once: its turn began
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        else:
            self.waiting_new.remove(req)
        self._release(req)
        if began and req.session_id is not None:
            self.cache.end_turn(req.session_id)
        req.status = Status.FINISHED
        req.finish_reason = reason
        del self.requests[req.request_id]
        # Often its last reference (its 121k-id list at 128k tokens took 0.2-0.4 ms to free): freed when the
        # engine is idle, not inside the step that finishes it (a needless flush ends at the next turn's schedule).
        collector.free_when_idle(req)

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None:
            self.finish(req, "abort")
        return req

    def _release(self, req: Request) -> None:
        self.cache.release(req)
        req.cache_handle = None
        req.num_computed_tokens = 0

    def computed(self, req: Request, num_tokens: int) -> None:
        """A step computed num_tokens more of req's tokens (the core tells it, token runs included). A prompt
        chunk's pages are published to the cache at once: a request that shares the prefix may already be on its
        way (four agents' first turns arrive within milliseconds, after the first one's first step began)."""
        req.num_computed_tokens += num_tokens
        if req.num_computed_tokens <= req.num_prompt_tokens:
            self.cache.publish(req)

    def start_flush(self, req: Request, reason: str) -> None:
        """req's answer is complete: one more step computes its last token's KV for the cache (or none, see
        _finish_needless_flushes), then it finishes with `reason`."""
        req.flushing, req.finish_reason = True, reason

    def handles(self) -> list[SeqCache]:
        """The running requests' cache handles."""
        return [_handle(r) for r in self.running]

    # ---- one step ----

    def _reserve(self, req: Request, num_tokens: int) -> bool:
        return self.cache.grow(_handle(req), num_tokens)

    def _pages_for(self, req: Request, num_tokens: int) -> int:
        return self.cache.pages_short(_handle(req), num_tokens)

    def _chunk(self, req: Request, budget: int) -> tuple[int, list[int]]:
        """A running request's tokens this step (a draft's included) and its draft."""
        n = self.cache.chunk(_handle(req), req.num_computed_tokens,
                             min(req.num_tokens - req.num_computed_tokens, budget), req.num_tokens)
        draft = self._draft(req, n, budget)
        return n + len(draft), draft

    def _draft(self, req: Request, n: int, budget: int) -> list[int]:
        """A draft for a request about to decode its next token, within the step's budget, its max_tokens
        and the context (every drafted token may become an output token, plus one more)."""
        if self.drafter is None or n != 1 or req.flushing or req.num_computed_tokens + 1 != req.num_tokens:
            return []
        limit = min(budget - 1, req.sampling.max_tokens - req.num_output_tokens - 1,
                    self.max_model_len - req.num_tokens - 1)
        draft = self.drafter.propose(req, limit)
        if draft and not self._reserve(req, req.num_tokens + len(draft)):
            return []  # a draft never preempts anyone: without room it is not scored
        return draft

    def trim_draft(self, req: Request) -> None:
        """After a verify: the pages past what the request's next token needs go back (a rejected tail)."""
        self.cache.trim(_handle(req), req.num_tokens)

    def _preempt(self, victim: Request) -> None:
        if victim.flushing:  # its answer is out already; only its cache entry is lost
            self.finish(victim, victim.finish_reason or "stop")
            return
        self.running.remove(victim)
        self._release(victim)
        victim.status = Status.WAITING
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)

    def _admission_need(self, req: Request, m: Match, n: int) -> int:
        """New device pages admitting req on m would take (slower tiers' parts of m are copied into new pages).
        Alone: its first chunk of n tokens (alone it always fits, max_model_len <= pool, and something must run).
        Beside running requests: its whole prompt plus their remaining prompts; admitting on the first chunk
        alone makes later chunks preempt each other in a loop (measured: 52 preemptions and 2x the prompt
        tokens computed in one replay)."""
        have = m.num_resident_tokens // self.page_size
        if not self.running:
            return -(-(m.num_tokens + n) // self.page_size) - have
        return max(0, -(-req.num_tokens // self.page_size) - have) + sum(
            max(0, self._pages_for(r, r.num_tokens)) for r in self.running
        )

    def _behind_its_flush(self, req: Request) -> bool:
        """Another request of req's session is running its flush step (its client has the answer, so the next turn
        can already be here): that turn's pages and its state snapshot go to the cache only when the step ends.
        Matched now, req would miss them; a model with state then resumes at an older snapshot, or at nothing
        once those were let go (seen: 1 in ~7 runs of the 4-session HTTP tests, a later turn with 0 cached)."""
        sid = req.session_id
        return sid is not None and any(r.flushing and r.session_id == sid for r in self.running)

    def _admit_first(self, req: Request, budget: int) -> int | None:
        """Admit a waiting request on its cached prefix when the pool has room for its first chunk; returns the
        chunk's size, or None (nothing taken). One tuple of its tokens serves the match and the turn's
        accounting: a 121k-token prompt's slice and tuple copies cost ~0.3 ms each. The prompt's int32 array, when
        the API process sent one, serves instead (the cache's compares are then C loops over 4-byte ints)."""
        arr = req.token_array(req.num_tokens)
        toks = tuple(req.all_token_ids) if arr is None else arr
        # Match at most num_tokens - 1 tokens: the last one must be computed to get logits to sample from.
        m = self.cache.match(toks, req.session_id, req.namespace, end=req.num_tokens - 1)
        if not self.cache.fits(m, self._admission_need(req, m, min(req.num_tokens - m.num_tokens, budget))):
            return None
        shown = self.cache.visible_tokens(m, req.namespace) if req.namespace else m.num_tokens
        lock = self.cache.lock(m, req.all_token_ids, req.history_end)
        return self._admit(req, lock, budget, shown, toks[: req.num_prompt_tokens])

    def _admit(self, req: Request, lock: Lock, budget: int, shown: int | None, prompt: Sequence[int]) -> int | None:
        """Start req on its locked prefix and reserve its first chunk; returns the chunk's size, or None when the
        chunk's pages cannot be had after all (the lock came back shorter than its match: the lock is undone and
        the request waits). At its first admission (not a return after preemption) its turn begins and its cache
        counters are set: they come from this admission, the one that ran. `prompt`: its prompt tokens (a tuple:
        the memo keeps it)."""
        h = lock.handle
        n = self.cache.chunk(h, lock.num_tokens, min(req.num_tokens - lock.num_tokens, budget), req.num_tokens)
        if not self.cache.grow(h, lock.num_tokens + n):
            self.cache.unlock(lock)
            return None
        req.cache_handle = h
        req.num_computed_tokens = lock.num_tokens
        if req.num_preemptions == 0:
            # What the request is told (and its session counts): under API-key namespaces, only the prefix
            # its own key's sessions computed (`shown`), so cached_tokens reveals nothing of another key's.
            t = self.cache.begin_turn(req.session_id, lock, req.namespace, prompt, shown)
            req.session_id = t.session
            req.num_cached_tokens = t.cached_tokens
            req.num_host_cached_tokens = t.host_cached_tokens
            req.num_recomputed_tokens = t.recomputed_tokens
        return n

    def new_session_fits(self, req: Request) -> bool:
        """Running work plus live leases leave room for this new session's prompt."""
        if not self.cache.gates_new_sessions:
            return True
        return self.cache.admits_new_session(-(-req.num_tokens // self.page_size), self.handles())

    def _expire_admissions(self, failed: list[tuple[Request, str, str]]) -> None:
        now = time.monotonic()
        while self.waiting_new and now - self.waiting_new[0].arrival > self.config.admission_timeout_s:
            req = self.waiting_new[0]
            self.admission_timeouts += 1
            failed.append((req, "admission_timeout",
                           f"the server is busy: no room for a new session within {self.config.admission_timeout_s:.0f} s"))
            self.finish(req, "error")

    def next_deadline(self) -> float | None:
        """When a blocked admission queue should be looked at again (monotonic), or None."""
        if self.running or self.waiting or not self.waiting_new:
            return None
        soonest = self.waiting_new[0].arrival + self.config.admission_timeout_s
        expiry = self.cache.next_lease_expiry()
        return soonest if expiry is None else min(soonest, expiry)

    def _finish_needless_flushes(self) -> None:
        """Finish the requests whose flush step (computing a finished request's last token) would give the cache
        nothing. Only whole pages are cached, so a flush adds one only when that token completes a page (1 turn
        in page_size); otherwise the request finishes on what it computed and the same pages go to the cache. A
        warm turn at 128k tokens spent ~5 ms of its engine's core on a flush over 121k keys that cached nothing.
        A model with state always flushes (its snapshots follow the steps it ran). Called at the next schedule,
        not when the last token is sampled: the client has its answer before the cache insert runs."""
        if self.cache.has_state:
            return
        ps = self.page_size
        for req in [r for r in self.running if r.flushing and r.num_tokens // ps <= r.num_computed_tokens // ps]:
            self.finish(req, req.finish_reason or "stop")

    def schedule(self) -> SchedulerOutput:
        budget = _Budget(self.config.max_num_batched_tokens, self.config.prefill_join_tokens)
        seqs: list[ScheduledSeq] = []
        failed: list[tuple[Request, str, str]] = []
        self._finish_needless_flushes()
        self.cache.before_schedule(self.running)
        i = 0
        while i < len(self.running) and budget.tokens > 0:
            req = self.running[i]
            prompt = req.num_tokens - req.num_computed_tokens > 1
            if (room := budget.left(prompt)) <= 0:
                i += 1
                continue  # a prompt finishes in this step: this one's chunk waits for the next
            n, draft = self._chunk(req, room)
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
                failed.append((req, "pool_too_small",
                               "the request does not fit the KV pool even alone; raise --kv-cache-gb or lower max_tokens"))
                i += 1
                continue
            seqs.append(ScheduledSeq(req, n, req.num_computed_tokens + n == req.num_tokens + len(draft)
                                     and not req.flushing, draft))
            budget.took(n, prompt, seqs[-1].sample)
            i += 1
        self._expire_admissions(failed)
        for queue in (self.waiting, self.waiting_new):
            while queue and budget.left(True) > 0 and len(self.running) < self.config.max_num_seqs:
                req = queue[0]
                if queue is self.waiting_new and not self.new_session_fits(req):
                    break  # FIFO: later new sessions wait behind it
                if self._behind_its_flush(req):
                    break  # its session's last turn reaches the cache when this step ends: match after that
                n = self._admit_first(req, budget.left(True))
                if n is None:
                    break  # nothing was taken: it looks again next step
                queue.popleft()
                req.status = Status.RUNNING
                self.running.append(req)
                seqs.append(ScheduledSeq(req, n, req.num_computed_tokens + n == req.num_tokens))
                budget.took(n, True, seqs[-1].sample)
        return SchedulerOutput(seqs, failed, self.cache.step_copies([_handle(s.request) for s in seqs]))
