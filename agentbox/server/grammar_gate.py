"""Every grammar a request brings is judged here before the request reaches the engine: a schema past the static
limits (chat/schema_check.py) or one whose compile outlasts its time or memory budget is a 400 naming the schema
path, and the engine never sees it. The compile runs in a worker process of its own (engine/grammar_worker.py:
an address-space cap), under a deadline held here (a compile past it is killed with its worker).

Verdicts are kept by the spec's digest, yes and no alike: an agent's tool set repeats every turn, and a hostile
schema sent again costs a dictionary lookup after its first refusal. The worker starts with the first spec that
needs it (a server whose clients never constrain output never pays its ~0.4 GB) and again after it was killed.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import multiprocessing as mp
import time
from collections import OrderedDict
from collections.abc import Callable
from multiprocessing.connection import Connection

from agentbox.chat.schema_check import SchemaRefused, check_schema
from agentbox.engine.grammar_spec import GrammarKind, GrammarSpec
from agentbox.engine.grammar_worker import FORMAT, WHOLE, Refusal, run_worker
from agentbox.server.errors import APIError

log = logging.getLogger("agentbox.server")

COMPILE_S = 5.0  # one spec's compile, at most (1,000 optional properties: 1.2 s on the 2-core Xeon; tools: 0.03 s)
COMPILE_MEMORY_BYTES = 2 * 2**30  # the worker's address space above what it holds once loaded
START_S = 120.0  # the worker's start (torch, xgrammar and the tokenizer), at most; not a schema's fault
MAX_GRAMMAR_BYTES = 1 * 2**20  # all of one request's schemas together, serialised
VERDICTS = 1024  # verdicts kept (digests: a few dozen bytes each)


class GrammarGate:
    def __init__(self, model: str, vocab_size: int, stop_token_ids: list[int], *, compile_s: float = COMPILE_S,
                 memory_bytes: int = COMPILE_MEMORY_BYTES) -> None:
        self.compile_s = compile_s
        self._args = (model, vocab_size, list(stop_token_ids), memory_bytes)
        self._verdicts: OrderedDict[bytes, Refusal | None] = OrderedDict()
        self._lock = asyncio.Lock()  # one compile at a time: the worker answers in order
        self._proc: mp.process.BaseProcess | None = None
        self._conn: Connection | None = None
        self._unavailable = False  # the worker could not start (logged once): grammars go to the engine unchecked
        self.compiles = 0  # specs compiled by the worker (cache misses that passed the static limits)
        self.refused = 0  # requests refused here (cached refusals included)

    async def admit(self, spec: GrammarSpec, param_of: Callable[[int], str]) -> None:
        """Returns when spec may go to the engine; else an APIError 400 naming the schema (`param_of(i)`: the
        request's path of tool i's schema, or of the response format's for FORMAT; WHOLE names the tools)."""
        key = hashlib.blake2b(repr(spec).encode(), digest_size=16).digest()
        if key in self._verdicts:
            self._verdicts.move_to_end(key)
            verdict = self._verdicts[key]
        else:
            verdict = _static(spec)
            if verdict is None:
                async with self._lock:
                    if key in self._verdicts:  # judged while this one waited
                        verdict = self._verdicts[key]
                    else:
                        verdict = await asyncio.to_thread(self.compile, spec)
            self._verdicts[key] = verdict
            while len(self._verdicts) > VERDICTS:
                self._verdicts.popitem(last=False)
        if verdict is not None:
            self.refused += 1
            param = (param_of(verdict.schema) if verdict.schema != WHOLE else "tools") + verdict.path
            raise APIError(400, f"{param}: {verdict.message}", param=param, code="invalid_schema")

    def compile(self, spec: GrammarSpec) -> Refusal | None:
        """The worker's verdict on spec within compile_s, uncached and without the static limits (on a thread:
        this blocks)."""
        conn = self._worker()
        if conn is None:
            return None  # no worker (logged): the engine compiles as it did before the gate
        self.compiles += 1
        t0 = time.monotonic()
        conn.send(spec)
        try:
            if conn.poll(self.compile_s):
                verdict = conn.recv()
                if verdict is not None and verdict.fatal:
                    self._stop()
                return verdict
        except (EOFError, OSError):
            self._stop()
            return Refusal(WHOLE, "the grammar compiler failed on this schema")
        self._stop()
        log.warning("a grammar compile outlasted %g s and was stopped (%.1f s)", self.compile_s, time.monotonic() - t0)
        return Refusal(WHOLE, f"compiling this schema into a grammar takes longer than {self.compile_s:g} s; "
                              "simplify it")

    def _worker(self) -> Connection | None:
        if self._conn is not None and self._proc is not None and self._proc.is_alive():
            return self._conn
        if self._unavailable:
            return None
        self._stop()
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=run_worker, args=(child, *self._args), name="agentbox-grammar", daemon=True)
        proc.start()
        child.close()
        try:
            ready = parent.poll(START_S) and parent.recv() == "ready"
        except (EOFError, OSError):
            ready = False
        if not ready:
            log.warning("the grammar compile worker did not start; grammars go to the engine unchecked by it")
            self._unavailable = True
            proc.kill()
            return None
        self._proc, self._conn = proc, parent
        return parent

    def _stop(self) -> None:
        proc, self._proc, self._conn = self._proc, None, None
        if proc is not None and proc.is_alive():
            proc.kill()
            proc.join(5)

    def close(self) -> None:
        self._stop()


def _static(spec: GrammarSpec) -> Refusal | None:
    """The limits checked without compiling (chat/schema_check.py), on every schema of spec."""
    schemas = [(FORMAT, spec.json_schema)] if spec.kind is GrammarKind.JSON else [
        (i, t.schema_json) for i, t in enumerate(spec.tools)]
    for i, text in schemas:
        if text is None:
            continue
        try:
            check_schema(json.loads(text), "")
        except SchemaRefused as e:
            return Refusal(i, e.reason, e.path)
    total = sum(len(s) for _, s in schemas if s is not None)
    if total > MAX_GRAMMAR_BYTES:
        return Refusal(WHOLE, f"the schemas together are {total:,} bytes; the limit is {MAX_GRAMMAR_BYTES:,}")
    return None
