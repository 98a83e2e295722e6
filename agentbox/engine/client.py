"""The API process's handle on the engine core process.

The core runs in its own process (spawned, so CUDA initialises cleanly there). One reader thread blocks on
the pipe and hands each output to the asyncio loop; the loop never polls.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing as mp
import threading
from collections.abc import AsyncIterator

from agentbox.config import EngineConfig
from agentbox.engine.messages import (
    AbortRequest,
    AddRequest,
    EngineFailed,
    EngineReady,
    Query,
    QueryReply,
    RequestOutput,
    Shutdown,
    StepOutputs,
)
from agentbox.engine.sampling import SamplingParams

log = logging.getLogger(__name__)


class EngineDead(RuntimeError):
    pass


class EngineClient:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.info: EngineReady | None = None
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._queries: dict[int, asyncio.Future[dict | None]] = {}
        self._ids = itertools.count()
        self._send_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._proc: mp.process.BaseProcess | None = None
        self.dead: str | None = None

    def start(self) -> EngineReady:
        """Spawns the core and blocks until it has loaded the model (or failed, raising with its reason)."""
        from agentbox.engine.core import run_engine_process

        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=run_engine_process, args=(child, self.config, _engine_log_level()),
            name="agentbox-engine", daemon=True,
        )
        self._proc.start()
        child.close()
        self._conn = parent
        try:
            msg = parent.recv()
        except EOFError as e:
            raise RuntimeError("the engine process died while loading the model; see the log above") from e
        if isinstance(msg, EngineFailed):
            self._proc.join(5)
            raise RuntimeError(f"the engine could not start: {msg.error}")
        assert isinstance(msg, EngineReady)
        self.info = msg
        return msg

    def attach_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        threading.Thread(target=self._reader, name="engine-reader", daemon=True).start()

    def _reader(self) -> None:
        loop = self._loop
        assert loop is not None
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                loop.call_soon_threadsafe(self._on_dead, "the engine process exited")
                return
            if isinstance(msg, StepOutputs):
                loop.call_soon_threadsafe(self._dispatch, msg.outputs)
            elif isinstance(msg, QueryReply):
                loop.call_soon_threadsafe(self._resolve_query, msg)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for o in outputs:
            q = self._queues.get(o.request_id)
            if q is not None:
                q.put_nowait(o)

    def _resolve_query(self, msg: QueryReply) -> None:
        fut = self._queries.pop(msg.query_id, None)
        if fut is not None and not fut.done():
            fut.set_result(msg.result)

    def _on_dead(self, why: str) -> None:
        self.dead = why
        for rid, q in self._queues.items():
            q.put_nowait(RequestOutput(rid, [], finished=True, finish_reason="error", error=why))
        for fut in self._queries.values():
            if not fut.done():
                fut.set_exception(EngineDead(why))

    def _send(self, msg: object) -> None:
        if self.dead:
            raise EngineDead(self.dead)
        with self._send_lock:
            self._conn.send(msg)

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams, session_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yields the request's outputs until it finishes. Closing the iterator early aborts the request,
        so a client that disconnects mid-stream gives its pages back."""
        q: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[request_id] = q
        finished = False
        try:
            self._send(AddRequest(request_id, prompt_token_ids, sampling, session_id))
            while True:
                o = await q.get()
                yield o
                if o.finished:
                    finished = True
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished and not self.dead:
                self._send(AbortRequest(request_id))

    def abort(self, request_id: str) -> None:
        if not self.dead:
            self._send(AbortRequest(request_id))

    async def query(self, kind: str, arg: str | None = None, timeout: float = 10.0) -> dict | None:
        """stats | sessions | session (arg: id) | drop_session (arg: id); answered between engine steps."""
        assert self._loop is not None
        qid = next(self._ids)
        fut: asyncio.Future[dict | None] = self._loop.create_future()
        self._queries[qid] = fut
        self._send(Query(qid, kind, arg))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._queries.pop(qid, None)

    async def stats(self) -> dict:
        return await self.query("stats") or {}

    def shutdown(self) -> None:
        if self._proc is None:
            return
        try:
            self._send(Shutdown())
        except (EngineDead, OSError, BrokenPipeError):
            pass
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(5)
        self._proc = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None


def _engine_log_level() -> int:
    # The engine's start-up lines (KV pool, attention backend and why) belong in the serve log. The API
    # process's root logger is usually unconfigured (WARNING by default), which must not silence them.
    return min(logging.getLogger().getEffectiveLevel(), logging.INFO)
