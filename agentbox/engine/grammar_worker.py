"""A grammar compile under a budget, in a process of its own: the API process asks it about every new
`GrammarSpec` before a request carrying it reaches the engine (server/grammar_gate.py), and the engine only ever
compiles a grammar this worker compiled within its budget.

The worker compiles exactly what the engine will (`GrammarCompiler`, engine/grammar.py), each schema alone
first (so a failure names its schema), then the whole spec, then asks the matcher for the forced continuation
from the start (`find_jump_forward_string`, what the closer calls: on a grammar that forces an endless output it
allocates until it fails). Its address space is capped (RLIMIT_AS) a budget above what it holds once loaded, so
such a grammar ends as a `bad_alloc` here, never in the engine; the API process holds the deadline and kills a
compile that outlasts it. xgrammar has no memory or time limit of its own for a compile (0.2.9:
`max_recursion_depth` bounds its parser's recursion, not a compile's size or time).
"""

from __future__ import annotations

import json
import logging
import resource
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from agentbox.engine.grammar_spec import GrammarKind, GrammarSpec, plain_grammar_error
from agentbox.engine.memory_ceiling import status_bytes

if TYPE_CHECKING:
    from agentbox.engine.grammar import GrammarCompiler  # xgrammar (and torch) load in the worker only

log = logging.getLogger(__name__)

MEMORY = "compiling it needs more memory than a grammar may use (or it forces an output without end)"
WHOLE = -2  # a failure of the spec as a whole (its tools together, the call syntax), not of one schema
FORMAT = -1  # the response format's schema (GrammarKind.JSON)


@dataclass(frozen=True)
class Refusal:
    """Why a spec cannot be compiled: `schema` is the index of the tool whose schema failed, FORMAT or WHOLE;
    `path` where inside that schema (".properties.child"; "" when not known); `fatal`: the worker ran out of its
    memory budget and exits after saying so."""

    schema: int
    message: str
    path: str = ""
    fatal: bool = False


def run_worker(conn: Connection, model: str, vocab_size: int, stop_token_ids: list[int], memory_bytes: int) -> None:
    """Entry point: load the tokenizer and xgrammar, cap the address space, then answer one spec per message
    (None: compiled; a Refusal otherwise) until the pipe closes."""
    from agentbox.engine.grammar import GrammarCompiler
    from agentbox.models.loader import load_tokenizer, resolve_model

    compiler = GrammarCompiler(load_tokenizer(resolve_model(model)), vocab_size, stop_token_ids=stop_token_ids,
                               max_threads=1)
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    held = status_bytes("VmSize")
    if held:  # Linux; elsewhere the deadline alone bounds a compile
        cap = held + memory_bytes
        resource.setrlimit(resource.RLIMIT_AS, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard))
    conn.send("ready")
    while True:
        try:
            spec = conn.recv()
        except EOFError:
            return
        refusal = try_compile(compiler, spec)
        compiler.clear_cache()  # the engine keeps its own; this one only says yes or no
        conn.send(refusal)
        if refusal is not None and refusal.fatal:
            return  # after a failed allocation nothing in this process is trusted again


def try_compile(compiler: GrammarCompiler, spec: GrammarSpec) -> Refusal | None:
    """None when spec compiles and its forced start ends; else why not, and which schema."""
    import xgrammar as xgr

    from agentbox.engine.grammar import bounded_strings_as_patterns

    def schema(text: str) -> Callable[[], object]:
        return lambda: xgr.Grammar.from_json_schema(bounded_strings_as_patterns(json.loads(text)),
                                                    any_whitespace=False, strict_mode=True)

    texts = [(FORMAT, spec.json_schema)] if spec.kind is GrammarKind.JSON else list(enumerate(
        t.schema_json for t in spec.tools))
    steps = [(i, schema(text)) for i, text in texts if text is not None]
    steps.append((WHOLE, lambda: xgr.GrammarMatcher(compiler.build(spec)).find_jump_forward_string()))
    for where, step in steps:
        try:
            step()
        except MemoryError:
            return Refusal(where, MEMORY, fatal=True)
        except Exception as e:  # noqa: BLE001 - xgrammar's errors are the schema's fault
            if "bad_alloc" in str(e):
                return Refusal(where, MEMORY, fatal=True)
            return Refusal(where, plain_grammar_error(e))
    return None
