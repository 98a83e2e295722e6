"""The engine core: scheduler + runner + prefix cache in one loop. Runs in its own process in serving
(`run_engine_process`), or in-process for the offline API and tests (`LLM`).

Idle means blocked: with no work the process loop sits in `conn.recv()`; it never sleeps-and-polls.
"""

from __future__ import annotations

import logging
import time
from multiprocessing.connection import Connection

from agentbox.config import EngineConfig
from agentbox.engine.kv_pool import PagePool
from agentbox.engine.messages import (
    AbortRequest,
    AddRequest,
    EngineFailed,
    EngineReady,
    RequestOutput,
    Shutdown,
    StatsQuery,
    StatsReply,
    StepOutputs,
)
from agentbox.engine.prefix_cache import NoCache, PrefixCache
from agentbox.engine.request import Request
from agentbox.engine.runner import ModelRunner
from agentbox.engine.scheduler import Scheduler
from agentbox.models.loader import LoadedModel

log = logging.getLogger(__name__)


def make_cache(config: EngineConfig, pool: PagePool, runner: ModelRunner) -> PrefixCache:
    return NoCache(pool)


class EngineCore:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.runner = ModelRunner(config, loaded)
        self.pool = PagePool(self.runner.num_pages, config.page_size)
        self.cache = make_cache(config, self.pool, self.runner)
        self.scheduler = Scheduler(config, self.pool, self.cache, self.runner.max_model_len)
        self.eos_token_ids = set(self.runner.loaded.eos_token_ids)
        self.started = time.time()
        self.counters = {
            "requests": 0,
            "prompt_tokens": 0,
            "cached_tokens": 0,
            "generated_tokens": 0,
            "computed_tokens": 0,
            "steps": 0,
            "preemptions": 0,
        }

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    def ready_message(self) -> EngineReady:
        lm = self.runner.loaded
        return EngineReady(
            model_name=lm.source.name,
            max_model_len=self.max_model_len,
            vocab_size=lm.vocab_size,
            eos_token_ids=sorted(self.eos_token_ids),
            num_pages=self.runner.num_pages,
            page_size=self.config.page_size,
            attention_backend=self.runner.backend.name,
            device=str(self.runner.device),
            dtype=self.config.resolved_dtype,
        )

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def add(self, msg: AddRequest) -> RequestOutput | None:
        """Queues a request; returns an immediate error output when it can never run."""
        n = len(msg.prompt_token_ids)
        if n == 0 or n >= self.max_model_len:
            why = "the prompt is empty" if n == 0 else (
                f"the prompt has {n} tokens; this server's context is {self.max_model_len} tokens"
            )
            return RequestOutput(msg.request_id, [], finished=True, finish_reason="error", error=why)
        req = Request(msg.request_id, list(msg.prompt_token_ids), msg.sampling, msg.session_id)
        self.scheduler.add(req)
        self.counters["requests"] += 1
        return None

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
        )

    def _stop_reason(self, req: Request, token: int) -> str | None:
        s = req.sampling
        if not s.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if token in s.stop_token_ids:
            return "stop"
        if len(req.output_token_ids) >= s.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None

    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        results: list[RequestOutput] = []
        for req in out.failed:
            self.scheduler.finish(req, "error")
            o = self._output(req, [], None)
            o.error = "the request does not fit the KV pool even alone; lower max_tokens or raise --kv-cache-gb"
            results.append(o)
        if not out.seqs:
            return results
        tokens, lps = self.runner.execute(out)
        self.counters["preemptions"] = self.scheduler.num_preemptions
        self.counters["steps"] += 1
        self.counters["computed_tokens"] += out.num_tokens
        sampled = iter(zip(tokens, lps, strict=True))
        for s in out.seqs:
            req = s.request
            req.num_computed_tokens += s.num_new_tokens
            if not s.sample:
                continue
            token, lp = next(sampled)
            if req.first_token_time is None:
                req.first_token_time = time.monotonic()
                self.counters["prompt_tokens"] += req.num_prompt_tokens
                self.counters["cached_tokens"] += req.num_cached_tokens
            req.output_token_ids.append(token)
            self.counters["generated_tokens"] += 1
            reason = self._stop_reason(req, token)
            if reason is not None:
                self.scheduler.finish(req, reason)
            results.append(self._output(req, [token], [lp] if lp is not None else None))
        return results

    def stats(self) -> dict:
        return {
            "uptime_s": time.time() - self.started,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "pool": {
                "total_pages": self.pool.capacity,
                "free_pages": self.pool.num_free,
                "used_pages": self.pool.num_used,
                "page_size": self.pool.page_size,
            },
            "cache": self.cache.stats(),
            "counters": dict(self.counters),
        }

    def check_integrity(self) -> None:
        self.cache.check_integrity()


def run_engine_process(conn: Connection, config: EngineConfig, log_level: int = logging.INFO) -> None:
    """Entry point of the engine core process."""
    logging.basicConfig(level=log_level, format="%(asctime)s engine %(levelname)s %(message)s")
    try:
        core = EngineCore(config)
    except Exception as e:  # any load failure is reported to the API process, which explains it
        log.exception("engine failed to start")
        conn.send(EngineFailed(f"{type(e).__name__}: {e}"))
        return
    conn.send(core.ready_message())

    def handle(msg: object) -> bool:
        if isinstance(msg, AddRequest):
            err = core.add(msg)
            if err is not None:
                conn.send(StepOutputs([err]))
        elif isinstance(msg, AbortRequest):
            o = core.abort(msg.request_id)
            if o is not None:
                conn.send(StepOutputs([o]))
        elif isinstance(msg, StatsQuery):
            conn.send(StatsReply(msg.query_id, core.stats()))
        elif isinstance(msg, Shutdown):
            return False
        return True

    try:
        while True:
            if not core.has_work():
                if not handle(conn.recv()):  # blocks: idle costs nothing
                    return
            while conn.poll():
                if not handle(conn.recv()):
                    return
            if core.has_work():
                outs = core.step()
                if outs:
                    conn.send(StepOutputs(outs))
    except (EOFError, BrokenPipeError):
        log.info("API process went away; engine exiting")
