"""The grammar a request decodes under, built in the API process: which family's call syntax, which
tools, which mode. The result is a plain `GrammarSpec` (engine/grammar_spec.py) that the engine compiles
and matches (engine/grammar.py); this side never imports xgrammar.

Every call is written in the parser family's own syntax, so what the grammar lets through is exactly what
`tool_parsers` reads back.
"""

from __future__ import annotations

import json
from typing import Any

from agentbox.chat.tool_parsers import ALIASES
from agentbox.engine.grammar_spec import (
    ArgStyle,
    CallMode,
    CallSyntax,
    GrammarKind,
    GrammarSpec,
    ReasoningMode,
    ToolSchema,
)

MAX_PARALLEL_CALLS = 4  # calls one `tool_choice=required` turn may make

SYNTAX: dict[str, CallSyntax] = {
    "hermes": CallSyntax('<tool_call>\n{"name": "', '", "arguments": ', "}\n</tool_call>", "<tool_call>",
                         ArgStyle.JSON),
    "qwen3_coder": CallSyntax("<tool_call>\n<function=", ">\n", "</function>\n</tool_call>", "<tool_call>",
                              ArgStyle.QWEN_XML),
    "glm45": CallSyntax("<tool_call>", "", "</tool_call>", "<tool_call>", ArgStyle.GLM_XML),
    "llama3_json": CallSyntax(
        '<|python_tag|>{"name": "', '", "parameters": ', "}", "<|python_tag|>", ArgStyle.JSON, separator="; "
    ),
    "mistral": CallSyntax("[TOOL_CALLS]", "[ARGS]", "", "[TOOL_CALLS]", ArgStyle.JSON, separator=""),
}
# When only calls may follow, Llama-3 writes bare objects (the parser reads them at the output's start).
BARE_LLAMA = CallSyntax('{"name": "', '", "parameters": ', "}", '{"name": ', ArgStyle.JSON, separator="; ")


def _function(tool: dict) -> dict:
    return tool.get("function", tool)


def _schema_json(tool: dict) -> str:
    params = _function(tool).get("parameters") or {"type": "object", "properties": {}}
    # Key order kept: xgrammar takes properties in the schema's order, and models write arguments in it (the
    # Qwen3.8 template prints them so); a key-sorted schema refused `old_string` after `file_path` in an Edit.
    return json.dumps(params, ensure_ascii=False)


def forced_name(tool_choice: Any) -> str | None:
    """The function name a `tool_choice` forces, in OpenAI or Anthropic shape, else None."""
    if isinstance(tool_choice, dict):
        if tool_choice.get("type") in ("function", "tool"):
            return (tool_choice.get("function") or {}).get("name") or tool_choice.get("name")
    return None


def grammar_spec(tools: list[dict] | None, tool_choice: Any, response_format: dict | None, parser_name: str | None,
                 reasoning: ReasoningMode = ReasoningMode.NONE, parallel_tool_calls: bool = True, *,
                 structural_tag_for_auto: bool = True) -> GrammarSpec | None:
    """The grammar a request decodes under, or None when output is free."""
    tools = [t for t in tools or [] if _function(t).get("name")]
    choice = tool_choice if tool_choice is not None else "auto"
    parser = ALIASES.get(parser_name or "", parser_name or "")
    name = forced_name(choice)
    if choice == "any":  # Anthropic's spelling of "required"
        choice = "required"
    if tools and choice != "none" and parser in SYNTAX:
        mode: CallMode | None = None
        if name is not None:
            chosen = [t for t in tools if _function(t)["name"] == name]
            if not chosen:
                raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
            mode, tools = CallMode.FORCED, chosen
        elif choice == "required":
            mode = CallMode.REQUIRED
        elif choice == "auto" and structural_tag_for_auto:
            mode = CallMode.AUTO
        if mode is not None:
            syntax = BARE_LLAMA if parser == "llama3_json" and mode is not CallMode.AUTO else SYNTAX[parser]
            return GrammarSpec(GrammarKind.TOOLS, reasoning, mode, syntax,
                               tuple(ToolSchema(_function(t)["name"], _schema_json(t)) for t in tools),
                               parallel=parallel_tool_calls, max_calls=MAX_PARALLEL_CALLS)
    rf = (response_format or {}).get("type")
    if rf == "json_object":
        return GrammarSpec(GrammarKind.JSON, reasoning)
    if rf == "json_schema":
        js = response_format.get("json_schema") or {}  # type: ignore[union-attr]
        schema = js.get("schema", js.get("json_schema")) if isinstance(js, dict) else None
        return GrammarSpec(GrammarKind.JSON, reasoning,
                           json_schema=json.dumps(schema or {"type": "object"}, sort_keys=True, ensure_ascii=False))
    return None
