"""The engine core process: its entry point and message loop around an `EngineCore` (core.py). The loop
receives typed messages from the API process (engine/ipc/client.py), steps the core and sends its outputs back;
a tp rank's death is reported and ends the process, whose restart is the API process's call.

Idle means blocked: with no work the process loop sits in `conn.recv()`; with only blocked admissions it
waits on the pipe until the next lease expiry or admission timeout. It never sleeps-and-polls.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from dataclasses import replace
from multiprocessing.connection import Connection

from agentbox import collector
from agentbox.config import EngineConfig
from agentbox.engine import memory_ceiling
from agentbox.engine.core import EngineCore
from agentbox.engine.exec.worker import RankDeath
from agentbox.engine.ipc.messages import (
    AbortRequest,
    AddRequest,
    EngineFailed,
    Query,
    QueryFailed,
    QueryReply,
    RequestOutput,
    Shutdown,
    StepOutputs,
)
from agentbox.engine.ipc.prompt_delta import RESEND, PromptStore

log = logging.getLogger(__name__)


def run_engine_process(conn: Connection, config: EngineConfig, log_level: int = logging.INFO) -> None:
    """Entry point of the engine core process."""
    logging.basicConfig(level=log_level, format="%(asctime)s engine %(levelname)s %(message)s")
    # Ctrl-C in a terminal reaches the whole process group; the API process owns the shutdown (it sends
    # Shutdown, or its exit closes the pipe), so the engine must not die mid-step with a traceback of its own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # No PR_SET_PDEATHSIG here: it fires when the parent *thread* ends, and a restarted engine is spawned
    # by a short-lived thread. The pipe's EOF ends this process when the API process goes.
    proc = _EngineProcess(conn)
    try:
        core = EngineCore(config, on_rank_death=proc.on_rank_death)
    except Exception as e:  # any load failure is reported to the API process, which explains it
        log.exception("engine failed to start")
        proc.send(EngineFailed(f"{type(e).__name__}: {e}"))
        return
    proc.core = core
    try:  # before the ceiling and before ready: agents send tools with every turn
        core.grammar_compiler()
    except Exception as e:  # noqa: BLE001 - a request with a grammar then reports the cause itself
        log.warning("grammar compiler not loaded at start (%s: %s)", type(e).__name__, e)
    memory_ceiling.apply(config)  # once loaded: no request can push the machine into its OOM killer
    proc.send(core.ready_message())
    collector.after_startup()  # collections run when the engine is idle (agentbox/collector.py)
    try:
        proc.loop(core)
        core.persist()  # Shutdown: a graceful stop writes the cache to disk first
    except (EOFError, BrokenPipeError):
        log.info("API process went away; engine exiting")
        core.persist()
    finally:
        core.close()


class _EngineProcess:
    """The engine process's side of the pipe: what each message does, the loop, and a rank's death."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.core: EngineCore | None = None
        self._send_lock = threading.Lock()  # the tp watchdog thread may report a death while the loop sends
        self.prompts = PromptStore()  # each session's last prompt: requests carry only the ids it lacks
        self._dying = threading.Lock()

    def send(self, msg: object) -> None:
        with self._send_lock:
            self.conn.send(msg)

    def on_rank_death(self, death: RankDeath) -> None:
        # A collective with a dead peer may never return (NCCL), so the loop cannot be trusted to notice:
        # report, end the other ranks, and exit; the API process fails in-flight requests and restarts us.
        # Called by the watchdog, or by the loop when a step fails because a peer went away.
        self._dying.acquire()  # once: the other caller blocks here until the process exits
        why = death.describe()
        log.error("%s; the engine exits", why)
        try:
            self.send(EngineFailed(why, dead_rank=death.rank))
        except OSError:
            pass
        if self.core is not None and self.core.workers is not None:
            self.core.workers.kill()
        os._exit(3)

    def loop(self, core: EngineCore) -> None:
        """Until Shutdown or the pipe's end: block while idle, else drain the pipe and step."""
        conn = self.conn
        while True:
            if not core.has_work():
                if not conn.poll():
                    collector.collect_idle()  # what the last turn left, before blocking
                # the next turns' prompt copies, one at a time (~0.4 ms at 128k) while nothing has arrived
                while not conn.poll() and self.prompts.prepare_spare():
                    pass
                if not self.handle(conn.recv()):  # blocks: idle costs nothing
                    return
            elif not core.progress_possible():
                # Only blocked admissions: wait for a message or the next lease expiry / admission timeout.
                if conn.poll(core.wait_timeout()) and not self.handle(conn.recv()):
                    return
            while conn.poll():
                if not self.handle(conn.recv()):
                    return
            if core.has_work():
                self._step(core)

    def _step(self, core: EngineCore) -> None:
        try:
            outs = core.step()
        except Exception:
            death = core.workers.wait_for_death(5.0) if core.workers is not None else None
            if death is not None:
                self.on_rank_death(death)  # does not return
            raise
        if outs:
            self.send(StepOutputs(outs))

    def handle(self, msg: object) -> bool:
        """One message from the API process; False on Shutdown."""
        core = self.core
        assert core is not None
        if isinstance(msg, AddRequest):
            self._add(core, msg)
        elif isinstance(msg, AbortRequest):
            o = core.abort(msg.request_id)
            if o is not None:
                self.send(StepOutputs([o]))
        elif isinstance(msg, Query):
            try:
                result = core.query(msg)
            except Exception as e:  # a bad query must not take the engine down
                log.exception("query failed")
                result = QueryFailed(f"{type(e).__name__}: {e}")
            self.send(QueryReply(msg.query_id, result))
        elif isinstance(msg, Shutdown):
            return False
        return True

    def _add(self, core: EngineCore, msg: AddRequest) -> None:
        prompt = self.prompts.rebuild(msg.session_id, msg.prompt_version, msg.prompt_token_ids, msg.base_version,
                                      msg.shared_tokens, msg.prompt_check)
        if prompt is None:  # not the prompt the API process built on: it sends the full ids
            self.send(StepOutputs([RequestOutput(msg.request_id, [], finished=True, finish_reason="error",
                                                 error="the engine lacks this prompt's base", error_code=RESEND)]))
            return
        msg = replace(msg, prompt_token_ids=prompt.ids, shared_tokens=0)
        try:
            err = core.add(msg, prompt)
        except Exception as e:  # a request that cannot even be queued fails alone
            log.exception("request %s could not be added", msg.request_id)
            err = RequestOutput(msg.request_id, [], finished=True, finish_reason="error",
                                error=f"this request failed in the engine: {type(e).__name__}: {e}",
                                error_code="request_failed")
        if err is not None:
            self.send(StepOutputs([err]))
