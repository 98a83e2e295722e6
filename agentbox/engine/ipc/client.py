"""The API process's handle on the engine core process.

The core runs in its own process (spawned, so CUDA initialises cleanly there). One reader thread blocks on
the pipe and hands each output to the asyncio loop; the loop never polls.

When the engine dies (a tensor-parallel rank was killed, OOM, a CUDA error), every in-flight request gets
an error that says why, `dead` makes /health answer unhealthy, and the engine is started again in the
background (what only memory held is lost; the log counts what came back from the disk tier). Restarts have a
budget per time window (config.py's `max_restarts` per `restart_window_s`): past it, or if it cannot start
again, the server is asked to exit and `gave_up` says why (the server then exits non-zero, so a supervisor
restarts it).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from multiprocessing.connection import Connection

from agentbox import collector
from agentbox.config import EngineConfig
from agentbox.engine.cache.stats import SessionDetail, SessionDropped, SessionList
from agentbox.engine.ipc.messages import (
    AbortRequest,
    AddRequest,
    EngineFailed,
    EngineReady,
    Query,
    QueryFailed,
    QueryKind,
    QueryReply,
    QueryResult,
    RequestOutput,
    Shutdown,
    StepOutputs,
)
from agentbox.engine.ipc.prompt_delta import RESEND, PromptSender
from agentbox.engine.sampling import SamplingParams
from agentbox.engine.stats import EngineStats

log = logging.getLogger(__name__)


class EngineDead(RuntimeError):
    pass


class QueryError(RuntimeError):
    """The engine could not answer a query (it logged why); the engine itself keeps running."""


class EngineClient:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.info: EngineReady | None = None
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._queries: dict[int, asyncio.Future[QueryResult]] = {}
        self._ids = itertools.count()
        self._send_lock = threading.Lock()
        self._prompts = PromptSender()  # each session's last prompt, as the engine keeps it
        self._loop: asyncio.AbstractEventLoop | None = None
        self._proc: mp.process.BaseProcess | None = None
        self.dead: str | None = None
        self.restarts = 0  # engine restarts after a death, for /v1/stats and the log
        self._deaths: deque[float] = deque()  # monotonic times of the deaths within the restart window
        self.gave_up: str | None = None  # why the server exits: the restart budget ran out, or a restart failed
        self.closing: str | None = None  # set when the server stops: new requests get a 503
        # How the server is asked to exit when the engine gives up (run_server sets uvicorn's should_exit;
        # a signal would be re-raised by uvicorn after shutdown and hide the exit code).
        self.on_give_up: Callable[[], None] = lambda: os.kill(os.getpid(), signal.SIGTERM)

    def _spawn(self) -> tuple[mp.process.BaseProcess, Connection, EngineReady]:
        """Spawns a core and blocks until it has loaded the model (or failed, raising with its reason)."""
        from agentbox.engine.ipc.core_process import run_engine_process

        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(
            target=run_engine_process, args=(child, self.config, _engine_log_level()),
            # Not a daemon: a daemonic process may not have children, and tp workers are its children. It
            # still ends with us: it exits on the pipe's EOF, and asks the kernel to kill it if we die.
            name="agentbox-engine", daemon=False,
        )
        proc.start()
        child.close()
        try:
            msg = parent.recv()
        except EOFError as e:
            proc.join(5)
            raise RuntimeError("the engine process died while loading the model; see the log above") from e
        if isinstance(msg, EngineFailed):
            proc.join(5)
            raise RuntimeError(f"the engine could not start: {msg.error}")
        assert isinstance(msg, EngineReady)
        return proc, parent, msg

    def start(self) -> EngineReady:
        self._proc, self._conn, self.info = self._spawn()
        # The engine is not a daemon (it has tp workers), and multiprocessing joins non-daemons at exit:
        # a server that fails after this point (say, its tokenizer) must still stop it, or exit would hang.
        atexit.register(self.shutdown)
        return self.info

    def attach_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._start_reader()

    def _start_reader(self) -> None:
        threading.Thread(target=self._reader, args=(self._conn,), name="engine-reader", daemon=True).start()

    def _reader(self, conn: Connection) -> None:
        loop = self._loop
        assert loop is not None

        def post(fn: Callable[..., None], *args: object) -> bool:
            try:
                loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # the loop closed: the server has shut down and nobody waits for the engine
                return False
            return True

        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                post(self._on_dead, "the engine process exited", conn)
                return
            if isinstance(msg, StepOutputs):
                ok = post(self._dispatch, msg.outputs)
            elif isinstance(msg, QueryReply):
                ok = post(self._resolve_query, msg)
            elif isinstance(msg, EngineFailed):  # a rank died; the engine exits right after this message
                ok = post(self._on_dead, msg.error, conn)
            else:
                ok = True
            if not ok:
                return

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for o in outputs:
            q = self._queues.get(o.request_id)
            if q is not None:
                q.put_nowait(o)

    def _resolve_query(self, msg: QueryReply) -> None:
        fut = self._queries.pop(msg.query_id, None)
        if fut is not None and not fut.done():
            fut.set_result(msg.result)

    def _on_dead(self, why: str, conn: Connection) -> None:
        if conn is not self._conn or self.dead is not None:
            return  # an older engine's last words, or the EOF that follows its failure message
        if self._proc is None:  # the EOF of a shutdown we asked for (`agentbox stop`, Ctrl-C): `shutdown` says so
            return
        self.dead = why
        log.error("engine failed: %s", why)
        self.fail_all(why, "engine_dead")
        for fut in self._queries.values():
            if not fut.done():
                fut.set_exception(EngineDead(why))
        threading.Thread(target=self._restart, args=(why,), name="engine-restart", daemon=True).start()

    def fail_all(self, why: str, code: str) -> None:
        """Ends every in-flight request with an error output (on the loop's thread): a stream then sends its
        client a typed error event and its end, rather than being cut."""
        for rid, q in self._queues.items():
            q.put_nowait(RequestOutput(rid, [], finished=True, finish_reason="error", error=why, error_code=code))

    def stop_requests(self, why: str) -> None:
        """The server is stopping (SIGTERM): from any thread, end every in-flight request with an error the
        client can read and refuse new ones, so no stream is cut without its error event and end."""
        self.closing = why
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._stop_all, why)

    def _stop_all(self, why: str) -> None:
        rids = list(self._queues)
        self.fail_all(why, "shutting_down")
        for rid in rids:  # the engine stops working for clients that are being told it ended
            with contextlib.suppress(EngineDead, OSError):
                self._send(AbortRequest(rid))

    def _within_budget(self) -> bool:
        """Counts this death; False when it is one more than the window's budget allows."""
        now, window = time.monotonic(), self.config.restart_window_s
        while self._deaths and self._deaths[0] < now - window:
            self._deaths.popleft()
        self._deaths.append(now)
        return len(self._deaths) <= self.config.max_restarts

    def _give_up(self, why: str) -> None:
        self.gave_up = why
        log.error("%s; the server exits (code 1) so that its supervisor can start it afresh", why)
        self.on_give_up()

    def _restart(self, why: str) -> None:
        old = self._proc
        if old is not None:
            old.join(10)  # it exits on its own after a rank death; reap it, workers included
            if old.is_alive():
                old.kill()
                old.join(5)
        if not self._within_budget():
            c = self.config
            self._give_up(f"the engine died {len(self._deaths)} times within {c.restart_window_s:g} s "
                          f"(restart budget: {c.max_restarts})")
            return
        self.restarts += 1
        try:
            proc, conn, info = self._spawn()
        except Exception as e:
            self._give_up(f"the engine could not restart ({e})")
            return
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._restarted, proc, conn, info, why)

    def _restarted(self, proc: mp.process.BaseProcess, conn: Connection, info: EngineReady, why: str) -> None:
        if self._proc is None:  # shut down while restarting
            conn.close()
            proc.kill()
            return
        with self._send_lock:
            self._proc, self._conn, self.info = proc, conn, info
            self._prompts.clear()  # the new engine knows no prompt
        self.dead = None
        self._start_reader()
        log.warning("engine restarted after: %s (restart %d; %s)", why, self.restarts, came_back(info))

    def _send(self, msg: object) -> None:
        if self.dead:
            raise EngineDead(self.dead)
        if self.closing and isinstance(msg, AddRequest):
            raise EngineDead(self.closing)
        with self._send_lock:
            self._conn.send(msg)

    async def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], sampling: SamplingParams, session_id: str | None = None,
        namespace: str = "", history_end: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Yields the request's outputs until it finishes. Closing the iterator early aborts the request,
        so a client that disconnects mid-stream gives its pages back."""
        q: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[request_id] = q
        finished = False
        try:
            msg = AddRequest(request_id, prompt_token_ids, sampling, session_id, namespace, history_end=history_end)
            self._send_add(msg)
            while True:
                o = await q.get()
                if o.error_code == RESEND:  # the engine lacks the base of the delta: the full ids, once
                    self._send_add(msg, False)
                    continue
                # Set before the yield: a caller that stops reading after the last output closes this generator
                # at the yield, and an abort sent then would cut the engine's flush step (the turn's last KV).
                finished = o.finished
                yield o
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not self._queues and self._loop is not None:  # the last request in flight: the server is idle
                self._loop.call_soon(collector.collect_idle)
            if not finished and not self.dead:
                self._send(AbortRequest(request_id))

    def _send_add(self, msg: AddRequest, delta: bool = True) -> None:
        """An AddRequest with only the ids the engine lacks for its session (engine/ipc/prompt_delta.py). Under
        the send lock: the engine must receive the prompts' versions in the order they were assigned."""
        if self.dead:
            raise EngineDead(self.dead)
        if self.closing:
            raise EngineDead(self.closing)
        with self._send_lock:
            if not delta:
                self._prompts.forget(msg.session_id)
            ids, version, base, shared, check = self._prompts.encode(msg.session_id, msg.prompt_token_ids)
            self._conn.send(replace(msg, prompt_token_ids=ids, prompt_version=version, base_version=base,
                                    shared_tokens=shared, prompt_check=check))

    def abort(self, request_id: str) -> None:
        if not self.dead:
            self._send(AbortRequest(request_id))

    async def query(self, kind: QueryKind, arg: str | None = None, timeout: float = 10.0) -> QueryResult:
        """One query, answered between engine steps (see QueryKind for what each kind returns)."""
        assert self._loop is not None
        qid = next(self._ids)
        fut: asyncio.Future[QueryResult] = self._loop.create_future()
        self._queries[qid] = fut
        self._send(Query(qid, kind, arg))
        try:
            res = await asyncio.wait_for(fut, timeout)
        finally:
            self._queries.pop(qid, None)
        if isinstance(res, QueryFailed):
            raise QueryError(f"the engine could not answer {kind.value}: {res.error}")
        return res

    async def stats(self) -> EngineStats:
        res = await self.query(QueryKind.STATS)
        assert isinstance(res, EngineStats)
        return res

    async def sessions(self) -> SessionList:
        res = await self.query(QueryKind.SESSIONS)
        assert isinstance(res, SessionList)
        return res

    async def session(self, session_id: str) -> SessionDetail | None:
        """The session's detail, or None when the engine does not know it."""
        res = await self.query(QueryKind.SESSION, session_id)
        assert res is None or isinstance(res, SessionDetail)
        return res

    async def drop_session(self, session_id: str) -> SessionDropped | None:
        """Forget a session (aborting its requests); None when the engine does not know it."""
        res = await self.query(QueryKind.DROP_SESSION, session_id)
        assert res is None or isinstance(res, SessionDropped)
        return res

    def shutdown(self) -> None:
        proc, self._proc = self._proc, None  # None first: the reader's EOF is then not a death to restart
        if proc is None:
            return
        try:
            with self._send_lock:
                self._conn.send(Shutdown())
        except (OSError, BrokenPipeError):
            pass
        proc.join(10 + self.config.disk_flush_s)  # a graceful stop writes the cache to disk first
        if proc.is_alive():
            proc.terminate()
            proc.join(5)
        # Logged here, not from the reader's EOF: that is posted to the event loop, which may close before it runs
        log.info("engine stopped")

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None


def came_back(info: EngineReady) -> str:
    """What of the cache a restarted engine found on its disk tier, for the restart's log line."""
    if not info.disk_budget_bytes:
        return "no disk tier: every session's cache was lost"
    states = f", {info.disk_states} state snapshots" if info.disk_states else ""
    return (f"from the disk tier {info.disk_pages} KV pages{states} and {info.disk_sessions} saved sessions came "
            "back; what only memory held since the last write is lost")


def _engine_log_level() -> int:
    # The engine's start-up lines (KV pool, attention backend and why) belong in the serve log. The API
    # process's root logger is usually unconfigured (WARNING by default), which must not silence them.
    return min(logging.getLogger().getEffectiveLevel(), logging.INFO)
