"""Tensor-parallel workers: ranks 1..N-1, each a spawned process holding its shard of the model.

Rank 0 (the engine core) owns the scheduler, the cache and the sessions; a worker owns only a ModelRunner.
Each step, rank 0 writes the packed `StepInputs` (engine/exec/step_inputs.py, a few hundred bytes for a decode
step) to every worker's pipe and all ranks run `execute`; the layers' collectives (NCCL on CUDA, shared
memory on CPU: parallel/shm_group.py) meet inside the forward pass. An idle worker is blocked in `recv_bytes` on its pipe: no spinning
collective, no polling sleep. An empty message (or the pipe closing) tells it to exit.

Death: a watchdog thread in rank 0 blocks on the workers' process sentinels. When one exits unasked, the
engine reports which rank died and exits itself (a collective with a dead peer may never return, on NCCL
in particular, or a shared-memory barrier); the API process then fails the in-flight requests and restarts the engine. Workers ask
the kernel to kill them if their parent dies, so no rank outlives the engine.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

import torch

from agentbox.config import EngineConfig
from agentbox.engine.exec.mtp import MtpStep, is_mtp_step
from agentbox.engine.exec.runner import ModelRunner, rank_device
from agentbox.engine.exec.step_inputs import StepInputs
from agentbox.parallel.shm_group import ShmGroup
from agentbox.parallel.state import init_distributed

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class WorkerFailed:
    """A worker's start-up error, sent to rank 0 before it exits."""

    rank: int
    error: str


@dataclass(frozen=True)
class RankDeath:
    rank: int
    pid: int | None
    exitcode: int | None

    def describe(self) -> str:
        how = f"killed by signal {-self.exitcode}" if self.exitcode is not None and self.exitcode < 0 else (
            f"exit code {self.exitcode}")
        return f"tensor-parallel rank {self.rank} (pid {self.pid}) died: {how}"


def die_with_parent() -> None:
    """Linux: the kernel kills this process when its parent dies, so no rank outlives its engine. (It is
    tied to the parent *thread*: workers are spawned from the engine's main thread, which lives as long.)"""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the pipe closing still ends the loop
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_main(
    rank: int, config: EngineConfig, port: int, shm: ShmGroup | None, conn: Connection, log_level: int
) -> None:
    """Entry point of rank `rank` (>= 1): join the group, load the shard, then run steps until told to stop."""
    die_with_parent()
    logging.basicConfig(level=log_level, format=f"%(asctime)s rank{rank} %(levelname)s %(message)s")
    try:
        init_distributed(rank, config.tensor_parallel_size, port, rank_device(config, rank), shm)
        runner = ModelRunner(config)
    except Exception as e:
        log.exception("rank %d failed to start", rank)
        conn.send(WorkerFailed(rank, f"{type(e).__name__}: {e}"))
        return
    while True:
        try:
            buf = conn.recv_bytes()  # blocks: an idle worker costs nothing
        except (EOFError, OSError):
            break
        if not buf:
            break
        if is_mtp_step(buf):  # the MTP head's part of the step just run (engine/exec/mtp.py)
            runner.run_mtp(MtpStep.unpack(buf))
        else:
            runner.execute(StepInputs.unpack(buf))


class TPWorkers:
    """Rank 0's handle on ranks 1..N-1: start them, send them steps, watch them, stop them."""

    def __init__(self, config: EngineConfig) -> None:
        self.size = config.tensor_parallel_size
        self.port = free_port()
        ctx = mp.get_context("spawn")
        # On CPU the ranks' collectives go through shared memory made here, before the workers exist.
        self.shm = ShmGroup.create(self.size, ctx) if rank_device(config, 0).type == "cpu" else None
        self.procs: list[mp.process.BaseProcess] = []
        self.conns: list[Connection] = []
        level = logging.getLogger().level or logging.INFO
        for rank in range(1, self.size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=worker_main, args=(rank, config, self.port, self.shm, child, level),
                            name=f"agentbox-tp{rank}", daemon=True)
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)
        self._closing = False
        self.send_seconds = 0.0  # time rank 0 spent writing steps to the workers (for the benchmarks)
        self.steps_sent = 0

    def failure(self) -> str | None:
        """A worker's start-up error or death, when there is one (used to explain a failed start)."""
        for rank, (p, c) in enumerate(zip(self.procs, self.conns, strict=True), start=1):
            try:
                if c.poll():
                    msg = c.recv()
                    if isinstance(msg, WorkerFailed):
                        return f"tensor-parallel rank {msg.rank} failed to start: {msg.error}"
            except (EOFError, OSError):
                pass
            if not p.is_alive():
                return RankDeath(rank, p.pid, p.exitcode).describe()
        return None

    def send_step(self, step: StepInputs) -> None:
        t0 = time.perf_counter()
        buf = step.pack()
        for c in self.conns:
            c.send_bytes(buf)
        self.send_seconds += time.perf_counter() - t0
        self.steps_sent += 1

    def send_mtp(self, plan: MtpStep) -> None:
        buf = plan.pack()
        for c in self.conns:
            c.send_bytes(buf)

    def watch(self, on_death: Callable[[RankDeath], None]) -> None:
        """Calls on_death (from a watchdog thread) when a worker exits while the engine still runs."""

        def run() -> None:
            death = self.wait_for_death(None)  # blocks until some worker exits
            if death is not None and not self._closing:
                on_death(death)

        threading.Thread(target=run, name="tp-watchdog", daemon=True).start()

    def wait_for_death(self, timeout: float | None) -> RankDeath | None:
        """The first dead worker, waiting up to `timeout` (None: forever) for one to exit. A failed
        collective usually means a peer is going down; its exit code follows in a moment."""
        ready = wait([p.sentinel for p in self.procs], timeout=timeout)
        for rank, p in enumerate(self.procs, start=1):
            if p.sentinel in ready:
                # The sentinel closes as the process tears down, a moment before it can be reaped.
                p.join(5.0)
                return RankDeath(rank, p.pid, p.exitcode)
        return None

    def close(self, timeout: float = 10.0) -> None:
        self._closing = True
        for c in self.conns:
            try:
                c.send_bytes(b"")
            except (OSError, BrokenPipeError):
                pass
        for p in self.procs:
            p.join(timeout)
            if p.is_alive():
                p.kill()
                p.join(5)
        for c in self.conns:
            c.close()

    def kill(self) -> None:
        """Ends every worker now (the engine is going down after a rank died)."""
        self._closing = True
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(5)


def _p2p_guard(config: EngineConfig) -> None:
    """Without GPU peer access NCCL's P2P transport can hang (multi-RTX-4090 boxes): route it through
    host memory instead, before any rank initialises NCCL (the workers inherit the environment)."""
    if rank_device(config, 0).type != "cuda" or "NCCL_P2P_DISABLE" in os.environ:
        return
    devs = [rank_device(config, r).index or 0 for r in range(config.tensor_parallel_size)]
    if any(not torch.cuda.can_device_access_peer(a, b) for a in devs for b in devs if a != b):
        log.warning("GPUs %s lack peer-to-peer access: setting NCCL_P2P_DISABLE=1", devs)
        os.environ["NCCL_P2P_DISABLE"] = "1"


def start_group(config: EngineConfig) -> TPWorkers | None:
    """At tp > 1: spawns the workers and joins the group as rank 0 (None at tp 1)."""
    if config.tensor_parallel_size == 1:
        return None
    _p2p_guard(config)
    workers = TPWorkers(config)
    # Join in a thread so that a worker dying before it joins fails the start now, not at the timeout.
    errors: list[BaseException] = []

    def join() -> None:
        try:
            init_distributed(0, workers.size, workers.port, rank_device(config, 0), workers.shm)
        except BaseException as e:  # noqa: BLE001 - handed to the starting thread
            errors.append(e)

    t = threading.Thread(target=join, name="tp-join", daemon=True)
    t.start()
    while t.is_alive():
        wait([p.sentinel for p in workers.procs], timeout=1.0)  # wakes at once when a worker exits
        if any(not p.is_alive() for p in workers.procs):
            why = workers.failure()
            workers.kill()
            raise RuntimeError(why or "a tensor-parallel worker exited during start-up")
    if errors:
        why = workers.failure()
        workers.kill()
        raise RuntimeError(why or f"the tensor-parallel group did not form: {errors[0]}") from errors[0]
    return workers
