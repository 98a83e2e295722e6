"""The scheduler: which requests run this step, and how many tokens each brings.

The idea, written where it is used: every running request wants `num_tokens - num_computed_tokens` more
tokens computed (1 when decoding, the rest of its prompt when prefilling). Running requests are served
first, oldest first, each taking what it needs from the step's token budget (a long prompt takes a chunk
and continues next step: chunked prefill). Then waiting requests are admitted while the budget, the
running cap and the pool allow: first requests of sessions coming back from a tool (and preempted ones),
then requests that start a new session. A new session is admitted only while running work plus the
sessions' leased working sets leave room for its prompt; otherwise it waits (FIFO, bounded), and past the
admission timeout it is refused (the API answers 429 with Retry-After). Leases stay soft: a running request
that needs pages breaks them through the cache's eviction order.

Admission looks before it takes: a pure cache lookup, then a pure check that the pages the request needs
(its first chunk alone, or its whole prompt beside the running requests' remaining prompts) are free or
reclaimable without touching its match; only then the lock (references, promotion from host, session tag,
lease) and the reservation. A request that does not fit leaves the cache exactly as it was. When the pool runs out for a running
request, the newest running request is preempted: its computed prefix goes to the prefix cache and it
waits to be recomputed (mostly from that cache). Nothing crashes for lack of pages.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from agentbox.config import EngineConfig
from agentbox.engine.cache.disk_states import DiskStates
from agentbox.engine.cache.manager import KVManager
from agentbox.engine.cache.radix_node import Lock, Match, Tier
from agentbox.engine.cache.state_snapshots import SnapshotPoint, SnapshotStore
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


class Scheduler:
    def __init__(self, config: EngineConfig, cache: KVManager, max_model_len: int) -> None:
        self.config = config
        self.cache = cache
        self.pool = cache.pool  # read only (sizes): pages are taken and given back through the cache
        self.max_model_len = max_model_len
        self.page_size = self.pool.page_size
        self.waiting: deque[Request] = deque()  # returning sessions and preempted requests
        self.waiting_new: deque[Request] = deque()  # requests that start a new session
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.admission_timeouts = 0
        self.admission_rejections = 0
        # A hybrid model's recurrent state resumes only at the exact position it was saved; with no snapshot
        # there, a cached prefix cannot be resumed, so such requests recompute from the start.
        self.recurrent_state = False
        self.snapshots: SnapshotStore | None = None  # set with recurrent_state when snapshots are kept
        self.disk_states: DiskStates | None = None  # set by the core: snapshots on the disk tier
        self.drafter: Drafter | None = None  # set by the core when speculative decoding is on

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
        self._release_pages(req)
        if began and req.session_id is not None:
            self.cache.end_turn(req.session_id)
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
        # The int32 array where there is one (the cache compares it at C speed), except for a hybrid model's
        # state snapshots, which digest a list.
        arr = req.token_array(full * self.page_size) if self.snapshots is None else None
        tokens = req.all_token_ids[: full * self.page_size] if arr is None else arr
        # The partial tail first: the free list is a stack, so pages freed after it come back before it and
        # the next request gets an ascending run (the torch backend's no-copy view path needs one).
        if len(req.pages) > full:
            self.cache.release(req.pages[full:])
        self.cache.insert(tokens, req.pages[:full], req.session_id)
        self._save_state(req, tokens)
        req.pages = []
        req.num_computed_tokens = 0

    def _save_state(self, req: Request, tokens: Sequence[int]) -> None:
        """The session's snapshot of its state at the end of the pages just cached, when the runner's
        page-aligned copy is at exactly that position (it always is at a turn's end, see _state_chunk)."""
        store = self.snapshots
        if store is None or req.session_id is None or req.table_row is None:
            return
        if not tokens or req.state_aligned_at != len(tokens):
            return
        store.save(req.session_id, SnapshotPoint.TURN, tokens, store.aligned_slot(req.table_row))

    def _save_prompt_states(self) -> None:
        """Running requests whose last step ended on their prompt's last page boundary: that state becomes
        the session's prompt snapshot (copied before the next step can overwrite it); those whose last step
        ended at their shared-prefix point (`_resume_point`): a shared snapshot."""
        store = self.snapshots
        if store is None:
            return
        for req in self.running:
            at = req.state_share_at
            if at and req.state_aligned_at == at and req.table_row is not None:
                req.state_share_at = 0
                store.save_shared(req.all_token_ids[:at], store.aligned_slot(req.table_row))
            boundary = req.num_prompt_tokens // self.page_size * self.page_size
            if req.state_prompt_saved or boundary == 0 or req.state_aligned_at != boundary:
                continue
            req.state_prompt_saved = True
            if req.session_id is not None and req.table_row is not None:
                store.save(req.session_id, SnapshotPoint.PROMPT, req.all_token_ids[:boundary],
                           store.aligned_slot(req.table_row))

    def _resume_point(self, req: Request, m: Match) -> Match:
        """For a hybrid model: m cut to the longest prefix a snapshot resumes (the session's own, or a shared
        prefix's), or to nothing. When m is longer, the request keeps its state at m's end as a shared snapshot.
        Host-tier pages come back with the lock (`_lock` drops the seed when they cannot)."""
        store = self.snapshots
        cut = Match((), 0, 0, m.session, m.epoch)
        req.state_share_at = 0
        if store is None:
            return cut
        found = [s for s in (store.find(m.session, req.all_token_ids, m.num_tokens),
                             store.find_shared(req.all_token_ids, m.num_tokens)) if s is not None]
        snap = max(found, key=lambda s: s.num_tokens, default=None)
        if self.disk_states is not None:  # a longer snapshot on disk (from before a restart) is read back
            seeds = {r.state_seed for r in self.running if r.state_seed is not None}
            snap = self.disk_states.resume(snap, req.all_token_ids, m.num_tokens, seeds)
        share_at = m.num_tokens // self.page_size * self.page_size
        if share_at > (snap.num_tokens if snap else 0):
            req.state_share_at = share_at
        if snap is None:
            return cut
        path = tuple(n for n in m.path if n.start < snap.num_tokens)
        host = sum(min(n.start + len(n.key), snap.num_tokens) - n.start for n in path if n.tier is Tier.HOST)
        store.used(snap)
        req.state_seed = snap.slot
        k = max(0, snap.num_tokens - (m.num_tokens - m.num_disk_tokens)) // self.page_size  # disk pages kept
        return Match(path, snap.num_tokens, host + k * self.page_size, m.session, m.epoch, m.disk[:k],
                     m.disk_tokens[: k * self.page_size])

    def _lock(self, req: Request, m: Match) -> Lock:
        """Lock m; for a hybrid model, all of it or nothing: a lock cut short (host pages that found no room, a
        disk read that came back short: a torn chunk, no room) ends where no snapshot describes the state, so
        the request computes from the start."""
        lock = self.cache.lock(m)
        if self.recurrent_state and lock.num_tokens != m.num_tokens:
            self.cache.release(lock.pages)
            req.state_seed, lock = None, Lock([], 0, 0, lock.session)
        return lock

    def pending_state_slots(self) -> set[int]:
        """Snapshot slots a queued copy fills at the next step (what they hold now is not their snapshot)."""
        return self.snapshots.pending_slots() if self.snapshots is not None else set()

    def take_state_copies(self) -> list[tuple[int, int]]:
        """The queued copies, for a caller that runs them itself (a graceful stop: no next step)."""
        return self.snapshots.take_copies() if self.snapshots is not None else []

    def _state_chunk(self, req: Request, n: int) -> int:
        """A hybrid model's prefill chunk ends on a page boundary when it can, and the prompt's last page
        boundary is always a chunk's end: the runner keeps the state at such ends, and the position a turn
        ends on (its cached pages) must be one of them."""
        if not self.recurrent_state:
            return n
        ps, start = self.page_size, req.num_computed_tokens
        end = start + n
        if start < req.state_share_at < end:
            return req.state_share_at - start
        last_boundary = req.num_tokens // ps * ps
        if end < req.num_tokens and end // ps * ps > start:
            return end // ps * ps - start
        if end == req.num_tokens and start < last_boundary < end:
            return last_boundary - start
        return n

    def running_refs(self) -> Counter[int]:
        return Counter(p for r in self.running for p in r.pages)

    # ---- one step ----

    def _pages_for(self, req: Request, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size) - len(req.pages)

    def _reserve(self, req: Request, num_tokens: int) -> bool:
        need = self._pages_for(req, num_tokens)
        if need <= 0:
            return True
        pages = self.cache.reserve(need)
        if pages is None:
            return False
        req.pages.extend(pages)
        return True

    def _chunk(self, req: Request, budget: int) -> tuple[int, list[int]]:
        """A running request's tokens this step (a draft's included) and its draft."""
        n = self._state_chunk(req, min(req.num_tokens - req.num_computed_tokens, budget))
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
        keep = -(-req.num_tokens // self.page_size)
        if len(req.pages) > keep:
            self.cache.release(req.trim_pages(keep))

    def _preempt(self, victim: Request) -> None:
        if victim.flushing:  # its answer is out already; only its cache entry is lost
            self.finish(victim, victim.finish_reason or "stop")
            return
        self.running.remove(victim)
        self._release_pages(victim)
        victim.status = Status.WAITING
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)

    def _admission_need(self, req: Request, m: Match, n: int) -> int:
        """New GPU pages admitting req on m would take (host parts of m are promoted into new pages). Alone:
        its first chunk of n tokens (alone it always fits, max_model_len <= pool, and something must run).
        Beside running requests: its whole prompt plus their remaining prompts; admitting on the first chunk
        alone makes later chunks preempt each other in a loop (measured: 52 preemptions and 2x the prompt
        tokens computed in one replay)."""
        have = m.num_gpu_tokens // self.page_size
        if not self.running:
            return -(-(m.num_tokens + n) // self.page_size) - have
        return max(0, -(-req.num_tokens // self.page_size) - have) + sum(
            max(0, self._pages_for(r, r.num_tokens)) for r in self.running
        )

    def _admit_first(self, req: Request, budget: int) -> int | None:
        """Admit a waiting request on its cached prefix when the pool has room for its first chunk; returns the
        chunk's size, or None (nothing taken). One tuple of its tokens serves the match and the turn's
        accounting: a 121k-token prompt's slice and tuple copies cost ~0.3 ms each. The prompt's int32 array, when
        the API process sent one, serves instead (the cache's compares are then C loops over 4-byte ints)."""
        arr = req.token_array(req.num_tokens)
        toks = tuple(req.all_token_ids) if arr is None else arr
        # Match at most num_tokens - 1 tokens: the last one must be computed to get logits to sample from.
        m = self.cache.match(toks, req.session_id, req.namespace, end=req.num_tokens - 1)
        if self.recurrent_state:
            req.state_seed = None
            m = self._resume_point(req, m)  # keeps the inferred session
        need = self._admission_need(req, m, min(req.num_tokens - m.num_tokens, budget))
        if need > self.pool.num_free and need > self.cache.reclaimable(m):
            return None
        shown = self.cache.visible_tokens(m, req.namespace) if req.namespace else m.num_tokens
        return self._admit(req, self._lock(req, m), budget, shown, toks[: req.num_prompt_tokens])

    def _admit(self, req: Request, lock: Lock, budget: int, shown: int | None, prompt: Sequence[int]) -> int:
        """Start req on its locked prefix and reserve its first chunk; returns the chunk's size. At its first
        admission (not a return after preemption) its turn begins and its cache counters are set: they come
        from this admission, the one that ran. `prompt`: its prompt tokens (a tuple: the memo keeps it)."""
        req.pages = list(lock.pages)
        req.num_computed_tokens = lock.num_tokens
        if req.num_preemptions == 0:
            # What the request is told (and its session counts): under API-key namespaces, only the prefix
            # its own key's sessions computed (`shown`), so cached_tokens reveals nothing of another key's.
            t = self.cache.begin_turn(req.session_id, lock, req.namespace, prompt, shown)
            req.session_id = t.session
            req.num_cached_tokens = t.cached_tokens
            req.num_host_cached_tokens = t.host_cached_tokens
            req.num_recomputed_tokens = t.recomputed_tokens
        req.state_aligned_at = 0  # its row's page-aligned copy is from before this admission
        req.state_prompt_saved = False
        n = self._state_chunk(req, min(req.num_tokens - req.num_computed_tokens, budget))
        if not self._reserve(req, req.num_computed_tokens + n):
            raise RuntimeError("admission: the cache could not free the pages it reported reclaimable")
        return n

    def new_session_fits(self, req: Request) -> bool:
        """Running work plus live leases leave room for this new session's prompt."""
        if not self.cache.gates_new_sessions:
            return True
        held = len({p for r in self.running for p in r.pages})
        return self.cache.admits_new_session(-(-req.num_tokens // self.page_size), held)

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
        expiries = [s.lease_expiry for s in self.cache.sessions.live() if s.lease_expiry is not None]
        return min([soonest, *expiries])

    def _finish_needless_flushes(self) -> None:
        """Finish the requests whose flush step (computing a finished request's last token) would give the cache
        nothing. Only whole pages are cached, so a flush adds one only when that token completes a page (1 turn
        in page_size); otherwise the request finishes on what it computed and the same pages go to the cache. A
        warm turn at 128k tokens spent ~5 ms of its engine's core on a flush over 121k keys that cached nothing.
        A hybrid model always flushes (its state snapshots follow the steps it ran). Called at the next
        schedule, not when the last token is sampled: the client has its answer before the cache insert runs."""
        if self.recurrent_state:
            return
        ps = self.page_size
        for req in [r for r in self.running if r.flushing and r.num_tokens // ps <= r.num_computed_tokens // ps]:
            self.finish(req, req.finish_reason or "stop")

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        seqs: list[ScheduledSeq] = []
        failed: list[tuple[Request, str, str]] = []
        self._finish_needless_flushes()
        self._save_prompt_states()
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n, draft = self._chunk(req, budget)
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
            budget -= n
            i += 1
        self._expire_admissions(failed)
        for queue in (self.waiting, self.waiting_new):
            while queue and budget > 0 and len(self.running) < self.config.max_num_seqs:
                req = queue[0]
                if queue is self.waiting_new and not self.new_session_fits(req):
                    break  # FIFO: later new sessions wait behind it
                n = self._admit_first(req, budget)
                if n is None:
                    break  # nothing was taken: it looks again next step
                queue.popleft()
                req.status = Status.RUNNING
                self.running.append(req)
                seqs.append(ScheduledSeq(req, n, req.num_computed_tokens + n == req.num_tokens))
                budget -= n
        return SchedulerOutput(seqs, failed, self.snapshots.take_copies() if self.snapshots is not None else [])
