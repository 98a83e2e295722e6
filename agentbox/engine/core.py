"""The engine core: scheduler + runner + prefix cache in one loop. Runs in its own process in serving
(`run_engine_process`, core_process.py), or in-process for the offline API and tests (`LLM`). `has_work`,
`progress_possible` and `wait_timeout` tell the process loop when it may block on the pipe.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from agentbox.config import EngineConfig, Speculative
from agentbox.engine.cache.manager import CacheShape, TurnRecord, build_cache
from agentbox.engine.draft import Drafter
from agentbox.engine.exec.runner import ModelRunner
from agentbox.engine.exec.worker import RankDeath, start_group
from agentbox.engine.grammar_spec import plain_grammar_error
from agentbox.engine.ipc.messages import (
    AddRequest,
    EngineReady,
    Query,
    QueryResult,
    RequestOutput,
    TokenLogprob,
)
from agentbox.engine.ipc.prompt_delta import Rebuilt
from agentbox.engine.loop_guard import LoopGuard
from agentbox.engine.reports import answer_query, engine_stats
from agentbox.engine.request import Request, Status
from agentbox.engine.scheduler import Scheduler
from agentbox.engine.stats import (
    EngineCounters,
    EngineStats,
)
from agentbox.models.loader import LoadedModel
from agentbox.parallel.state import destroy_distributed

if TYPE_CHECKING:
    from agentbox.engine.grammar import GrammarCompiler, GrammarState  # xgrammar loads when first needed

log = logging.getLogger(__name__)


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel | None = None,
        on_rank_death: Callable[[RankDeath], None] | None = None,
    ) -> None:
        """At tp > 1 this spawns ranks 1..N-1 and joins their group as rank 0; `on_rank_death` is called
        from a watchdog thread when one dies (default: the next step raises, naming the rank)."""
        if config.tensor_parallel_size > 1 and config.host_cache_gb != 0.0:
            # The host tier copies pages of rank 0's KV pool only; with heads spread over ranks it would
            # need every rank to copy in step. Until then tp > 1 runs without it.
            log.info("tensor parallel %d: the host-RAM KV tier is off", config.tensor_parallel_size)
            config = replace(config, host_cache_gb=0.0)
        self.config = config
        self.rank_death: RankDeath | None = None
        self.workers = start_group(config)
        try:
            self.runner = ModelRunner(config, loaded, self.workers)
        except Exception as e:
            if self.workers is None:
                raise
            why = self.workers.failure()
            self.close()
            raise RuntimeError(why or str(e)) from e
        if self.workers is not None:
            self.workers.watch(on_rank_death or self._note_death)
        r = self.runner
        self.cache = build_cache(config, CacheShape(
            kv=r.kv_cache, num_pages=r.num_pages, page_size=r.page_size, num_rows=r.num_rows,
            state=r.state_cache, num_snapshots=r.num_snapshots, num_host_snapshots=r.num_host_snapshots,
            state_in_place=r.state_in_place,
        ))
        self.drafter = self._drafter(config)
        # The runner may run fewer requests than asked where per-sequence state is large (a small card).
        self.scheduler = Scheduler(replace(config, max_num_seqs=r.max_num_seqs), self.cache, r.max_model_len,
                                   self.drafter)
        self.eos_token_ids = set(r.loaded.eos_token_ids)
        self.started = time.time()
        self._grammar_compiler = None
        self.counters = EngineCounters()
        self._next_prune = 0.0

    def _drafter(self, config: EngineConfig) -> Drafter | None:
        if config.speculative is Speculative.OFF:
            return None
        head = self.runner.mtp is not None
        if config.speculative is Speculative.MTP and not head:
            raise ValueError(f"--speculative mtp: {config.model} has no multi-token-prediction head (no mtp.* "
                             "weights, or a config without mtp_num_hidden_layers); use suffix or auto")
        return Drafter(config, mtp=head)

    def _note_death(self, death: RankDeath) -> None:
        log.error("%s", death.describe())
        self.rank_death = death

    def persist(self) -> None:
        """A graceful stop: the cache's unsaved pages and the session table to the disk tier, within
        config.disk_flush_s (engine/cache/radix_disk.py)."""
        t0 = time.monotonic()
        written, left, states = self.cache.persist(self.config.disk_flush_s)
        st = self.cache.stats()
        if st.disk_budget_bytes:  # said even when turn ends wrote it all behind: the log is where a user looks
            log.info("disk tier at stop: %d KV pages of %d sessions on disk (%d written now, %d behind at turn ends; "
                     "%d state snapshots) in %.1f s%s", st.disk_pages, len(self.cache.sessions), written,
                     st.disk_written_behind, states, time.monotonic() - t0,
                     f"; {left} pages left unsaved (--disk-flush-s)" if left else "")

    def close(self) -> None:
        """Stops the tensor-parallel workers and leaves the group (nothing to do at tp 1)."""
        if self.workers is not None:
            self.workers.close()
            self.workers = None
            destroy_distributed()

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    def ready_message(self) -> EngineReady:
        lm = self.runner.loaded
        cache = self.cache.stats()
        return EngineReady(
            model_name=lm.source.name,
            max_model_len=self.max_model_len,
            vocab_size=lm.vocab_size,
            eos_token_ids=sorted(self.eos_token_ids),
            num_pages=self.runner.num_pages,
            page_size=self.runner.page_size,
            attention_backend=self.runner.backend.name,
            device=str(self.runner.device),
            dtype=self.config.resolved_dtype,
            tensor_parallel_size=self.runner.tp,
            weight_bytes_per_rank=list(self.runner.weight_bytes_per_rank),
            model_max_len=lm.max_model_len,
            disk_budget_bytes=cache.disk_budget_bytes, disk_pages=cache.disk_pages,
            disk_sessions=cache.disk_sessions, disk_states=cache.disk_states,
        )

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ---- requests ----

    def grammar_compiler(self) -> GrammarCompiler:
        """The engine's grammar compiler, built on first use (xgrammar and the tokenizer's vocabulary table: ~0.8 s
        for a 49k vocabulary on one EPYC core); the serving engine process builds it at startup, so an agent's
        first turn does not wait for it."""
        if self._grammar_compiler is None:
            from agentbox.engine.grammar import GrammarCompiler
            from agentbox.models.loader import load_tokenizer, resolve_model

            tok = load_tokenizer(resolve_model(self.config.model))
            self._grammar_compiler = GrammarCompiler(
                tok, self.runner.loaded.vocab_size, stop_token_ids=sorted(self.eos_token_ids),
                close_window=self.config.grammar_close_window,
            )
        return self._grammar_compiler

    def _grammar_state(self, req: Request) -> GrammarState | None:
        spec = req.sampling.grammar
        return None if spec is None else self.grammar_compiler().state(spec)

    def add(self, msg: AddRequest, rebuilt: Rebuilt | None = None) -> RequestOutput | None:
        """Queues a request; returns an immediate error output when it can never run or cannot queue.
        `rebuilt`: the engine process's own copy of msg's ids (core_process.py), taken as they are."""
        n = len(msg.prompt_token_ids)
        if n == 0 or n >= self.max_model_len:
            why = "the prompt is empty" if n == 0 else (
                f"the prompt has {n} tokens; this server's context is {self.max_model_len} tokens"
            )
            return RequestOutput(msg.request_id, [], finished=True, finish_reason="error", error=why,
                                 error_code="prompt_too_long")
        req = Request(msg.request_id, list(msg.prompt_token_ids) if rebuilt is None else rebuilt.ids, msg.sampling,
                      msg.session_id, namespace=msg.namespace,
                      history_end=msg.history_end if 0 < msg.history_end < n else 0)
        req.prompt_ids = None if rebuilt is None else rebuilt.array
        try:
            req.grammar_state = self._grammar_state(req)
            # ignore_eos asks for exactly max_tokens tokens (benchmarks): no guard cuts those short
            req.loop_guard = None if msg.sampling.ignore_eos else LoopGuard.from_config(self.config)
        except Exception as e:  # a schema xgrammar cannot compile is the request's fault
            return RequestOutput(msg.request_id, [], finished=True, finish_reason="error",
                                 error=f"cannot build a grammar for this request: {plain_grammar_error(e)}",
                                 error_code="bad_grammar")
        self.prune_sessions(room=1)  # the new request may start a session
        code = self.scheduler.add(req)
        if code is None:  # what its prefix has on disk is read while it waits
            self.cache.prefetch(req.all_token_ids, req.session_id, req.namespace, end=n - 1)
        else:
            return RequestOutput(msg.request_id, [], finished=True, finish_reason="error", error_code=code,
                                 error="the server's admission queue is full; retry shortly")
        self.counters.requests += 1
        return None

    def prune_sessions(self, room: int = 0) -> int:
        """Forgets sessions idle past `session_idle_s`, and the longest idle beyond `max_sessions - room`
        entries (a session with a request in flight stays). Returns how many went."""
        table, cfg = self.cache.sessions, self.config  # read here; forget_session writes
        now = table.clock()
        over = len(table) + room - cfg.max_sessions
        if over <= 0 and now < self._next_prune:
            return 0
        self._next_prune = now + 1.0  # a sort of the table at most once a second
        busy = self.busy_sessions()
        gone = 0
        for s in sorted(table, key=lambda s: s.last_active):
            if s.id in busy or s.in_turn:
                continue
            if over - gone <= 0 and now - s.last_active < cfg.session_idle_s:
                break  # oldest first: the rest are more recent still
            self.cache.forget_session(s.id)
            gone += 1
        return gone

    def busy_sessions(self) -> set[str | None]:
        """Sessions with a request in the engine (queued or running)."""
        return {r.session_id for r in self.scheduler.requests.values()}

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.scheduler.abort(request_id)
        if req is None:
            return None
        return self._output(req, [], None)

    def _output(self, req: Request, new: list[int], lps: list | None) -> RequestOutput:
        return RequestOutput(
            req.request_id,
            new,
            lps,
            finished=req.is_finished,
            finish_reason=req.finish_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
            num_host_cached_tokens=req.num_host_cached_tokens,
            num_recomputed_tokens=req.num_recomputed_tokens,
            num_drafted_tokens=req.num_drafted,
            num_accepted_tokens=req.num_accepted,
            session_id=req.session_id,
        )

    def _stop_reason(self, req: Request, token: int) -> str | None:
        s = req.sampling
        if not s.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if token in s.stop_token_ids:
            return "stop"
        gs = req.grammar_state
        if gs is not None and gs.is_terminated():
            return "stop"
        if req.loop_guard is not None and req.loop_guard.feed(token) and not (gs is not None and gs.closing):
            log.warning("loop guard: request %s repeats a %d-token cycle; %s", req.request_id,
                        req.loop_guard.period, "closing its grammar" if gs is not None else "ending it (length)")
            if gs is None:
                return "length"
            gs.start_closing("loop")  # a grammar-bound output ends at a point its grammar accepts
        if gs is not None:
            gs.check_budget(min(s.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens),
                            req.num_output_tokens)
        if req.num_output_tokens >= s.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _first_token(self, req: Request) -> None:
        now = time.monotonic()
        req.first_token_time = now
        c = self.counters
        c.prompt_tokens += req.num_prompt_tokens
        c.cached_tokens += req.num_cached_tokens
        c.host_cached_tokens += req.num_host_cached_tokens
        c.recomputed_history_tokens += req.num_recomputed_tokens
        if req.session_id is not None:
            ttft = now - req.arrival
            self.cache.first_token(req.session_id, ttft, TurnRecord(
                turn=0, prompt_tokens=req.num_prompt_tokens, cached_tokens=req.num_cached_tokens,
                host_cached_tokens=req.num_host_cached_tokens, recomputed_tokens=req.num_recomputed_tokens,
                ttft_s=round(ttft, 4),
            ))

    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        results: list[RequestOutput] = []
        for req, code, why in out.failed:
            self.scheduler.finish(req, "error")
            o = self._output(req, [], None)
            o.error, o.error_code = why, code
            results.append(o)
        self.counters.preemptions = self.scheduler.num_preemptions
        if not out.seqs:
            return results
        if self.rank_death is not None:
            raise RuntimeError(self.rank_death.describe())
        result = self.runner.step(out)
        for h, position in result.aligned:  # before any request below ends: its snapshot reads this
            self.cache.aligned(h, position)
        tokens, lps, failed = result.tokens, result.logprobs, result.failed
        c = self.counters
        c.steps += 1
        c.computed_tokens += out.num_tokens
        row = 0
        for s in out.seqs:
            req = s.request
            decoding = req.num_computed_tokens >= req.num_prompt_tokens
            if decoding:
                c.decode_tokens += s.num_new_tokens
            else:
                c.prefill_tokens += s.num_new_tokens
            self.scheduler.computed(req, s.num_new_tokens - len(s.draft))  # accepted drafts count in _accept_run
            if req.flushing:
                self.scheduler.finish(req, req.finish_reason or "stop")
                continue
            if not s.sample:
                continue
            i, row = row, row + 1
            why = failed.get(i)
            if why is None:
                try:
                    results.append(self._accept_run(req, tokens[i], lps[i], len(s.draft)))
                    if self.drafter is not None and i < len(result.drafts) and (d := result.drafts[i]) is not None:
                        self.drafter.offer(req, d.tokens, d.after)
                    continue
                except Exception as e:  # noqa: BLE001 - its grammar or stop check: this request's fault alone
                    why = f"{type(e).__name__}: {e}"
            results.append(self._fail(req, why))
        return results

    def _fail(self, req: Request, why: str) -> RequestOutput:
        """Ends one request whose own sampling or bookkeeping raised; the engine and the batch carry on."""
        log.error("request %s failed in the engine (the others carry on): %s", req.request_id, why)
        self.counters.request_failures += 1
        self.scheduler.finish(req, "error")
        o = self._output(req, [], None)
        o.error, o.error_code = f"this request failed in the engine: {why}", "request_failed"
        return o

    def _accept_run(self, req: Request, tokens: list[int], lp: TokenLogprob | None, drafted: int) -> RequestOutput:
        """A step's tokens into their request, up to the first that ends it. Past the first, each is a draft
        token the verify agreed with: its KV was computed in this step, so it counts as computed."""
        out = self._accept(req, tokens[0], lp)
        gs = req.grammar_state
        for t in tokens[1:]:
            if out.finished or (gs is not None and gs.closing is not None):
                break  # a grammar that starts closing forces its next tokens: the verified rows did not
            self.scheduler.computed(req, 1)
            more = self._accept(req, t, None)
            out.new_token_ids += more.new_token_ids
            out.finished, out.finish_reason = more.finished, more.finish_reason
        if drafted and self.drafter is not None:
            self.drafter.observe(req, drafted, len(tokens) - 1)
            self.counters.drafted_tokens += drafted
            self.counters.accepted_tokens += len(tokens) - 1
            if req.is_running:
                self.scheduler.trim_draft(req)
            out.num_drafted_tokens, out.num_accepted_tokens = req.num_drafted, req.num_accepted
        return out

    def _accept(self, req: Request, token: int, lp: TokenLogprob | None) -> RequestOutput:
        """One sampled token into its request: grammar, stop checks, the output the client gets."""
        c = self.counters
        if req.first_token_time is None:
            self._first_token(req)
        req.append_output(token)
        c.generated_tokens += 1
        if req.grammar_state is not None:
            req.grammar_state.accept(token)
        reason = self._stop_reason(req, token)
        out_ = self._output(req, [token], [lp] if lp is not None else None)
        if reason is not None:
            self._record_completion(req)
            out_.finished, out_.finish_reason = True, reason
            if self.cache.caches_completions:
                # The answer is complete for the client now; one more step computes the last token's KV
                # (batched with the others) so the next turn finds prompt + completion cached, when that
                # token completes a page (the scheduler finishes it without the step otherwise).
                self.scheduler.start_flush(req, reason)
            else:
                self.scheduler.finish(req, reason)
        return out_

    def _record_completion(self, req: Request) -> None:
        if self.drafter is not None:
            self.drafter.finished(req)
        if req.session_id:
            self.cache.complete_turn(req.session_id, req.num_output_tokens)

    # ---- queries ----

    def stats(self) -> EngineStats:
        return engine_stats(self)

    def query(self, q: Query) -> QueryResult:
        return answer_query(self, q)

    def check_integrity(self) -> None:
        self.cache.check_integrity(self.scheduler.handles())

    def wait_timeout(self) -> float | None:
        """How long the process loop may block on the pipe: None (forever) when idle."""
        deadline = self.scheduler.next_deadline()
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    def progress_possible(self) -> bool:
        sch = self.scheduler
        return bool(sch.running or sch.waiting) or (
            bool(sch.waiting_new) and sch.new_session_fits(sch.waiting_new[0])
        )


__all__ = ["EngineCore", "Status"]
