"""Constrained decoding with xgrammar, the engine's side: compile a `GrammarSpec` (cached), match it per
request, and close an output that must end before its budget does.

The sampler's side is small: `GrammarState.fill_bitmask(bitmask, row)` before sampling a row, `accept(token)`
after; a state that is closing names the one token to take (`forced_token`). JSON is compact: no free
whitespace (separators are fixed to json.dumps' `", "` and `": "`, the same as templates' `tojson`), so a
weak model cannot wander in whitespace and the re-rendered transcript matches what the model wrote.

Closing. A grammar guarantees the shape of a call but not its end: a weak model can loop inside an
unbounded array until max_tokens cuts the call mid-JSON, and one malformed call in fifty turns sinks a
60-turn task. So within `grammar_close_window` tokens of the budget the state measures how many tokens the
greedy closer needs to reach the grammar's end (on a fork of the matcher) and starts closing when that is
all the budget left allows; the loop guard starts it too. The closer is greedy, not a search: stop tokens
first, then the literals that end what is open (a string's quote, `}`, `]`, the family's suffix, `</think>`),
then the cheapest token the grammar allows (short structural characters before letters). Strings are told
from structure by whether the grammar would take an ordinary letter next.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
import xgrammar as xgr
from xgrammar.structural_tag import (
    AnyTextFormat,
    ConstStringFormat,
    GrammarFormat,
    JSONSchemaFormat,
    OptionalFormat,
    SequenceFormat,
    StructuralTag,
    TagFormat,
    TagsWithSeparatorFormat,
    TriggeredTagsFormat,
)

from agentbox.engine.exec.bitmask import allocate_bitmask
from agentbox.engine.grammar_spec import ArgStyle, CallMode, GrammarKind, GrammarSpec, ReasoningMode

CACHE_ENTRIES = 128
XGR_CACHE_BYTES = 256 * 2**20
NEED_JUMP = 32  # the most one token can add to the closer's need (a separator that forces a new call)
MAX_CLOSE_TOKENS = 256  # a closure longer than this is not attempted (the output ends by `length`)
# Single characters the fallback prefers, cheapest first: ends of structure, then digits, then letters.
CHEAP_CHARS = '"}]>0123456789\n<=/ :,abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_-.'


@dataclass(frozen=True)
class CompiledGrammar:
    spec: GrammarSpec
    compiled: xgr.CompiledGrammar


def allowed_tokens(bitmask: torch.Tensor, row: int, vocab_size: int) -> torch.Tensor:
    """A bool [vocab] of what row `row` of an xgrammar bitmask allows."""
    words = bitmask[row].to(torch.int64) & 0xFFFFFFFF
    bits = (words.unsqueeze(1) >> torch.arange(32)) & 1
    return bits.flatten()[:vocab_size].bool()


# The longest string bound the grammar enforces. xgrammar (0.2.9) admits no escape sequence in a length-bounded
# string, native or as a pattern, so a `minLength: 1` command could hold no quote or newline; and it unrolls a
# bound into a state per character, each with a token mask over the vocabulary, so compile time grows with the
# bound and, past ~1,000, faster (a 49k vocabulary on a 2-core Xeon: {0,32} 0.3 s, {0,128} 1.1 s, {0,2048} 2.0 s,
# 8192 38 s). Claude Code's Workflow tool bounds its script at 524,288 and ListAgents three strings at 256: with
# them its tool set compiled in 3.3 s, past the gate's 5 s on a loaded machine, and its first request was refused.
MAX_STRING_BOUND = 32


def bounded_strings_as_patterns(schema: Any) -> Any:
    """Rewrite short length-bounded strings (maxLength <= MAX_STRING_BOUND) as a pattern: xgrammar's own rule for
    them admits raw control characters (seen: a call whose argument held a raw 0x15, which no JSON parser
    accepts), its pattern rule does not. Other bounds are left to the client's validation and the string is
    plain JSON, escapes included."""
    if isinstance(schema, list):
        return [bounded_strings_as_patterns(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: bounded_strings_as_patterns(v) for k, v in schema.items()}
    if (out.get("type") == "string" and ("maxLength" in out or "minLength" in out)
            and not {"pattern", "enum", "const", "format"} & out.keys()):
        lo, hi = int(out.pop("minLength", 0)), out.pop("maxLength", None)
        if hi is not None and int(hi) <= MAX_STRING_BOUND:
            out["pattern"] = r'^[^\x00-\x1f"\\]{' + f"{min(lo, int(hi))},{int(hi)}" + "}$"
    return out


class Closer:
    """The greedy closer for one tokenizer and one grammar family (see the module docstring)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        cost = torch.full((vocab_size,), 1000.0)
        for tid in range(min(vocab_size, len(tokenizer))):
            text = tokenizer.decode([tid])
            if len(text) == 1 and text in CHEAP_CHARS:
                cost[tid] = CHEAP_CHARS.index(text)
            elif text:
                cost[tid] = 100 + len(text)
        self.cost = cost
        self._bitmask = allocate_bitmask(1, vocab_size)
        self._encoded: dict[str, list[int]] = {}

    def _tokens(self, text: str) -> list[int]:
        if text not in self._encoded:
            self._encoded[text] = list(self.tokenizer.encode(text, add_special_tokens=False))
        return self._encoded[text]

    @staticmethod
    def literals(spec: GrammarSpec, in_text: bool) -> list[str]:
        syntax = spec.syntax
        suffix = syntax.suffix if syntax is not None else ""
        tails = [suffix[i:] for i in range(len(suffix)) if suffix[i:].strip()]
        think = ["</think>\n\n", "</think>"] if spec.reasoning is not ReasoningMode.NONE else []
        xml = ["\n</parameter>\n", "\n</parameter>", "</parameter>", "</arg_value>"] if (
            syntax is not None and syntax.style is not ArgStyle.JSON) else []
        if in_text:
            return [*think, *xml, '"', *tails]
        return [*xml, "}", "]", *tails, '"', ": ", "0", "false", "null", ", "]

    def choose(self, matcher: xgr.GrammarMatcher, spec: GrammarSpec) -> list[int]:
        """The next tokens towards the end of the grammar from the matcher's state (not accepted here)."""
        for stop in self.stop_token_ids:
            if matcher.fork().accept_token(stop):
                return [stop]
        forced = matcher.find_jump_forward_string()  # what the grammar allows only one way of writing
        in_text = matcher.fork().accept_string("a")
        for lit in [forced] if forced else self.literals(spec, in_text):
            after = matcher.fork()
            if not after.accept_string(lit):
                continue
            if in_text and not forced and not self._left_text(after):
                continue  # e.g. `</parameter>` written inside a JSON string: still text, no progress
            toks, probe = self._tokens(lit), matcher.fork()
            if toks and all(probe.accept_token(t) for t in toks):
                return list(toks)  # a copy: the state pops its queue, the cache must keep its entry
        matcher.fill_next_token_bitmask(self._bitmask, 0)
        allowed = allowed_tokens(self._bitmask, 0, self.vocab_size)
        if not bool(allowed.any()):
            return []
        return [int(torch.where(allowed, self.cost, torch.inf).argmin())]

    def _left_text(self, m: xgr.GrammarMatcher) -> bool:
        return not m.fork().accept_string("a") or any(m.fork().accept_token(t) for t in self.stop_token_ids)

    def length(self, matcher: xgr.GrammarMatcher, spec: GrammarSpec, limit: int) -> int | None:
        """How many tokens the closer needs from this state to the grammar's end (None: more than limit)."""
        sim, n = matcher.fork(), 0
        while not sim.is_terminated():
            toks = self.choose(sim, spec)
            if not toks or n + len(toks) > limit:
                return None
            for t in toks:
                sim.accept_token(t)
            n += len(toks)
        return n


class GrammarState:
    """One request's matcher: the sampler fills its row of the bitmask, then reports the token taken."""

    def __init__(self, grammar: CompiledGrammar, closer: Closer, close_window: int) -> None:
        self.spec = grammar.spec
        self.matcher = xgr.GrammarMatcher(grammar.compiled)
        self.closer = closer
        self.close_window = close_window
        self.closing: str | None = None  # why the state is closing: "budget" | "loop"
        self._queue: list[int] = []
        self._next_check = 0

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        if self._queue and self._queue[0] == token_id:
            self._queue.pop(0)
        else:
            self._queue.clear()
        return bool(self.matcher.accept_token(int(token_id)))

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())

    def advance(self, token_id: int) -> bool:
        """Accepts a draft token while a verify looks ahead (exec/verify.py); `rollback` undoes it."""
        return bool(self.matcher.accept_token(int(token_id)))

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.matcher.rollback(num_tokens)

    def start_closing(self, reason: str) -> None:
        if self.closing is None and not self.is_terminated():
            self.closing = reason

    def forced_token(self) -> int | None:
        """The token a closing state must take next (None when not closing or nothing is allowed)."""
        if self.closing is None or self.is_terminated():
            return None
        if not self._queue:
            self._queue = self.closer.choose(self.matcher, self.spec)
        return self._queue[0] if self._queue else None

    def check_budget(self, remaining: int, generated: int) -> None:
        """Start closing when the budget left is all the closer needs. Measured only near the end, and
        again only after half the slack beyond one jump is spent, so a call pays for few simulations."""
        if self.closing is not None or remaining > self.close_window or generated < self._next_check:
            return
        if self.is_terminated():
            return
        need = self.closer.length(self.matcher, self.spec, min(MAX_CLOSE_TOKENS, remaining + self.close_window))
        if need == 1 and self.spec.mode is CallMode.AUTO:
            return  # free text that may end now: it runs to its budget and ends by `length`, as text does
        # One token can raise the need by a whole new call (a separator, then a forced prefix), so closing
        # starts while that much slack is left; until then, measure again after half the rest is spent.
        slack = remaining - 1 - (need if need is not None else remaining) - NEED_JUMP
        if slack <= 0:
            self.closing = "budget"
        else:
            self._next_check = generated + max(1, slack // 2)


class GrammarCompiler:
    """Compiles and caches grammars for one tokenizer. Thread-safe; cache bounded (LRU)."""

    def __init__(self, tokenizer: Any, vocab_size: int, *, stop_token_ids: list[int] | None = None,
                 max_threads: int = 2, close_window: int = 96) -> None:
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.close_window = close_window
        # xgrammar's own cache of compiled grammars, bounded by its own limit (unbounded by default: it kept every
        # grammar ever compiled, beside this class's LRU of CACHE_ENTRIES)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=max_threads, cache_limit_bytes=XGR_CACHE_BYTES)
        self._cache: OrderedDict[GrammarSpec, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self._closer: Closer | None = None
        self.hits = 0
        self.misses = 0

    @property
    def closer(self) -> Closer:
        if self._closer is None:  # decoding the vocabulary takes a moment: only when a grammar is used
            self._closer = Closer(self.tokenizer, self.vocab_size, list(self.info.stop_token_ids))
        return self._closer

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                self.hits += 1
                return hit
        compiled = CompiledGrammar(spec, self.build(spec))
        with self._lock:
            self.misses += 1
            self._cache[spec] = compiled
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return compiled

    def state(self, spec: GrammarSpec) -> GrammarState:
        return GrammarState(self.compile(spec), self.closer, self.close_window)

    def cache_info(self) -> dict[str, int]:
        return {"entries": len(self._cache), "hits": self.hits, "misses": self.misses}

    def clear_cache(self) -> None:
        with self._lock:
            self._cache.clear()
        self.compiler.clear_cache()

    # ---- building ---------------------------------------------------------------------------
    def build(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """Compile spec, bypassing this compiler's cache (`compile` is the cached way)."""
        if spec.kind is GrammarKind.JSON:
            schema = json.loads(spec.json_schema) if spec.json_schema is not None else None
            body: Any = self._json_format(schema, strict=schema is not None)
        else:
            body = self._tools_format(spec)
        return self.compiler.compile_structural_tag(StructuralTag(format=_with_reasoning(body, spec.reasoning)))

    @staticmethod
    def _json_format(schema: dict | None, strict: bool = True) -> GrammarFormat:
        grammar = xgr.Grammar.from_json_schema(
            bounded_strings_as_patterns(schema) if schema is not None else {"type": "object"},
            any_whitespace=False, strict_mode=strict,
        )
        return GrammarFormat(grammar=str(grammar))

    def _tools_format(self, spec: GrammarSpec) -> Any:
        syntax = spec.syntax
        assert syntax is not None and spec.mode is not None  # chat/grammar.py builds TOOLS specs whole

        def tag(name: str, schema_json: str) -> TagFormat:
            schema = json.loads(schema_json)
            if syntax.style is ArgStyle.JSON:
                content: Any = self._json_format(schema)
            else:
                content = JSONSchemaFormat(json_schema=bounded_strings_as_patterns(schema), style=syntax.style.value,
                                           max_whitespace_cnt=1)
            return TagFormat(begin=syntax.prefix + name + syntax.infix, content=content, end=syntax.suffix)

        tags = [tag(t.name, t.schema_json) for t in spec.tools]
        one = not spec.parallel
        if spec.mode is CallMode.FORCED:
            return tags[0]
        if spec.mode is CallMode.REQUIRED:
            call = TagsWithSeparatorFormat(tags=tags, separator=syntax.separator or " ", at_least_one=True,
                                           stop_after_first=True)
            if one:
                return call
            # At most max_calls calls, unrolled: an unbounded repetition lets a weak model under greedy
            # decoding call forever (each further call is as likely as the first) until max_tokens.
            more: Any = None
            for _ in range(spec.max_calls - 1):
                step = [ConstStringFormat(value=syntax.separator)] if syntax.separator else []
                step.append(call)
                if more is not None:
                    step.append(more)
                more = OptionalFormat(content=SequenceFormat(elements=step))
            return SequenceFormat(elements=[call, more]) if more is not None else call
        return TriggeredTagsFormat(triggers=[syntax.trigger], tags=tags, stop_after_first=one)


def _with_reasoning(body: Any, reasoning: ReasoningMode) -> Any:
    """Free reasoning first when the model thinks: `inside` (prompt ends with <think>) or `optional`."""
    if reasoning is ReasoningMode.NONE:
        return body
    inside = reasoning is ReasoningMode.INSIDE
    block = TagFormat(begin="" if inside else "<think>", content=AnyTextFormat(), end="</think>")
    # Templates put a blank line between reasoning and answer; allow it, nothing else, before the body.
    block = SequenceFormat(elements=[block, OptionalFormat(content=ConstStringFormat(value="\n\n"))])
    prefix: Any = block if inside else OptionalFormat(content=block)
    return SequenceFormat(elements=[prefix, body])
