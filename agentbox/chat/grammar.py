"""Constrained decoding with xgrammar: one grammar per distinct (tools, choice, format, syntax) key.

The sampler's side is small: `GrammarState.fill_bitmask(bitmask, row)` before sampling a row,
`accept(token)` after. Every call is written in the parser family's own syntax, so what the grammar
lets through is exactly what `tool_parsers` reads back. JSON is compact: no free whitespace (separators
are fixed to json.dumps' `", "` and `": "`, the same as templates' `tojson`), so even a weak model
cannot wander in whitespace and the re-rendered transcript matches what the model wrote.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

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

from agentbox.chat.tool_parsers import ALIASES

Reasoning = Literal["none", "inside", "optional"]
CACHE_ENTRIES = 128
MAX_PARALLEL_CALLS = 4  # calls one `tool_choice=required` turn may make


@dataclass(frozen=True)
class CallSyntax:
    """How one family writes a call: `prefix name infix ARGS suffix`; `trigger` starts one in free text."""

    prefix: str
    infix: str
    suffix: str
    trigger: str
    style: str  # json | qwen_xml | glm_xml
    separator: str = "\n"  # between calls when only calls are allowed


SYNTAX: dict[str, CallSyntax] = {
    "hermes": CallSyntax('<tool_call>\n{"name": "', '", "arguments": ', "}\n</tool_call>", "<tool_call>", "json"),
    "qwen3_coder": CallSyntax("<tool_call>\n<function=", ">\n", "</function>\n</tool_call>", "<tool_call>", "qwen_xml"),
    "glm45": CallSyntax("<tool_call>", "", "</tool_call>", "<tool_call>", "glm_xml"),
    "llama3_json": CallSyntax(
        '<|python_tag|>{"name": "', '", "parameters": ', "}", "<|python_tag|>", "json", separator="; "
    ),
    "mistral": CallSyntax("[TOOL_CALLS]", "[ARGS]", "", "[TOOL_CALLS]", "json", separator=""),
}
# When only calls may follow, Llama-3 writes bare objects (the parser reads them at the output's start).
BARE_LLAMA = CallSyntax('{"name": "', '", "parameters": ', "}", '{"name": ', "json", separator="; ")


@dataclass(frozen=True)
class CompiledGrammar:
    key: str
    compiled: xgr.CompiledGrammar


class GrammarState:
    """One request's matcher: the sampler fills its row of the bitmask, then reports the token taken."""

    def __init__(self, grammar: CompiledGrammar) -> None:
        self.matcher = xgr.GrammarMatcher(grammar.compiled)

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        return bool(self.matcher.accept_token(int(token_id)))

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())

    def rollback(self, num_tokens: int = 1) -> None:
        self.matcher.rollback(num_tokens)


def allocate_bitmask(batch_size: int, vocab_size: int) -> Any:
    return xgr.allocate_token_bitmask(batch_size, vocab_size)


def apply_bitmask(logits: Any, bitmask: Any, indices: list[int] | None = None) -> None:
    """Mask disallowed tokens to -inf in place (rows in `indices`, or all)."""
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=indices)


def _function(tool: dict) -> dict:
    return tool.get("function", tool)


def _schema(tool: dict) -> dict:
    params = _function(tool).get("parameters") or {"type": "object", "properties": {}}
    return bounded_strings_as_patterns(params)


def bounded_strings_as_patterns(schema: Any) -> Any:
    """Rewrite length-bounded strings as an equivalent pattern. xgrammar's rule for minLength/maxLength
    strings admits raw control characters (seen: a call whose argument held a raw 0x15, which no JSON parser
    accepts); its pattern rule escapes them as JSON requires."""
    if isinstance(schema, list):
        return [bounded_strings_as_patterns(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: bounded_strings_as_patterns(v) for k, v in schema.items()}
    if (out.get("type") == "string" and ("maxLength" in out or "minLength" in out)
            and not {"pattern", "enum", "const", "format"} & out.keys()):
        lo, hi = int(out.pop("minLength", 0)), out.pop("maxLength", None)
        upper = "" if hi is None else str(int(hi))
        out["pattern"] = r'^[^\x00-\x1f"\\]{' + f"{lo},{upper}" + "}$"
    return out


def forced_name(tool_choice: Any) -> str | None:
    """The function name a `tool_choice` forces, in OpenAI or Anthropic shape, else None."""
    if isinstance(tool_choice, dict):
        if tool_choice.get("type") in ("function", "tool"):
            return (tool_choice.get("function") or {}).get("name") or tool_choice.get("name")
    return None


class GrammarCompiler:
    """Compiles and caches grammars for one tokenizer. Thread-safe; cache bounded (LRU)."""

    def __init__(self, tokenizer: Any, vocab_size: int, *, stop_token_ids: list[int] | None = None,
                 max_threads: int = 2, structural_tag_for_auto: bool = True) -> None:
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self.vocab_size = vocab_size
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=max_threads)
        self.structural_tag_for_auto = structural_tag_for_auto
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    # ---- the one entry point the server calls -------------------------------------------------
    def compile_for_request(
        self,
        tools: list[dict] | None,
        tool_choice: Any,
        response_format: dict | None,
        parser_name: str | None,
        *,
        reasoning: Reasoning = "none",
        parallel_tool_calls: bool = True,
    ) -> CompiledGrammar | None:
        """The grammar this request decodes under, or None when output is free."""
        spec = self.request_spec(tools, tool_choice, response_format, parser_name, reasoning, parallel_tool_calls)
        if spec is None:
            return None
        key = json.dumps(spec, sort_keys=True, ensure_ascii=False)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return hit
        compiled = CompiledGrammar(key, self._compile(spec))
        with self._lock:
            self.misses += 1
            self._cache[key] = compiled
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return compiled

    def request_spec(self, tools: list[dict] | None, tool_choice: Any, response_format: dict | None,
                     parser_name: str | None, reasoning: Reasoning = "none",
                     parallel_tool_calls: bool = True) -> dict | None:
        """The canonical description of a request's grammar (its cache key), or None for free output."""
        tools = [t for t in tools or [] if _function(t).get("name")]
        choice = tool_choice if tool_choice is not None else "auto"
        parser = ALIASES.get(parser_name or "", parser_name or "")
        name = forced_name(choice)
        if choice == "any":  # Anthropic's spelling of "required"
            choice = "required"
        if tools and choice != "none" and parser in SYNTAX:
            if name is not None:
                chosen = [t for t in tools if _function(t)["name"] == name]
                if not chosen:
                    raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
                mode, tools = "forced", chosen
            elif choice == "required":
                mode = "required"
            elif choice == "auto" and self.structural_tag_for_auto:
                mode = "auto"
            else:
                mode = ""
            if mode:
                fns = [{"name": _function(t)["name"], "parameters": _schema(t)} for t in tools]
                return {"kind": "tools", "mode": mode, "parser": parser, "tools": fns,
                        "reasoning": reasoning, "parallel": parallel_tool_calls}
        rf = (response_format or {}).get("type")
        if rf == "json_object":
            return {"kind": "json", "schema": None, "reasoning": reasoning}
        if rf == "json_schema":
            js = response_format.get("json_schema") or {}  # type: ignore[union-attr]
            schema = js.get("schema", js.get("json_schema")) if isinstance(js, dict) else None
            return {"kind": "json", "schema": schema or {"type": "object"}, "reasoning": reasoning}
        return None

    def cache_info(self) -> dict[str, int]:
        return {"entries": len(self._cache), "hits": self.hits, "misses": self.misses}

    def clear_cache(self) -> None:
        with self._lock:
            self._cache.clear()
        self.compiler.clear_cache()

    # ---- building ---------------------------------------------------------------------------
    def _compile(self, spec: dict) -> xgr.CompiledGrammar:
        if spec["kind"] == "json":
            body: Any = self._json_format(spec["schema"], strict=spec["schema"] is not None)
        else:
            body = self._tools_format(spec)
        return self.compiler.compile_structural_tag(StructuralTag(format=_with_reasoning(body, spec["reasoning"])))

    @staticmethod
    def _json_format(schema: dict | None, strict: bool = True) -> GrammarFormat:
        grammar = xgr.Grammar.from_json_schema(
            schema if schema is not None else {"type": "object"}, any_whitespace=False, strict_mode=strict
        )
        return GrammarFormat(grammar=str(grammar))

    def _tools_format(self, spec: dict) -> Any:
        syntax = SYNTAX[spec["parser"]]
        mode = spec["mode"]
        if spec["parser"] == "llama3_json" and mode != "auto":
            syntax = BARE_LLAMA

        def tag(fn: dict) -> TagFormat:
            if syntax.style == "json":
                content: Any = self._json_format(fn["parameters"])
            else:
                content = JSONSchemaFormat(json_schema=fn["parameters"], style=syntax.style, max_whitespace_cnt=1)
            end = syntax.suffix
            return TagFormat(begin=syntax.prefix + fn["name"] + syntax.infix, content=content, end=end)

        tags = [tag(fn) for fn in spec["tools"]]
        one = not spec["parallel"]
        if mode == "forced":
            return tags[0]
        if mode == "required":
            call = TagsWithSeparatorFormat(tags=tags, separator=syntax.separator or " ", at_least_one=True,
                                           stop_after_first=True)
            if one:
                return call
            # At most MAX_PARALLEL_CALLS calls, unrolled: an unbounded repetition lets a weak model under
            # greedy decoding call forever (each further call is as likely as the first) until max_tokens.
            more: Any = None
            for _ in range(MAX_PARALLEL_CALLS - 1):
                step = [ConstStringFormat(value=syntax.separator)] if syntax.separator else []
                step.append(call)
                if more is not None:
                    step.append(more)
                more = OptionalFormat(content=SequenceFormat(elements=step))
            return SequenceFormat(elements=[call, more]) if more is not None else call
        return TriggeredTagsFormat(triggers=[syntax.trigger], tags=tags, stop_after_first=one)


def _with_reasoning(body: Any, reasoning: Reasoning) -> Any:
    """Free reasoning first when the model thinks: `inside` (prompt ends with <think>) or `optional`."""
    if reasoning == "none":
        return body
    block = TagFormat(begin="" if reasoning == "inside" else "<think>", content=AnyTextFormat(), end="</think>")
    # Templates put a blank line between reasoning and answer; allow it, nothing else, before the body.
    block = SequenceFormat(elements=[block, OptionalFormat(content=ConstStringFormat(value="\n\n"))])
    prefix: Any = block if reasoning == "inside" else OptionalFormat(content=block)
    return SequenceFormat(elements=[prefix, body])
