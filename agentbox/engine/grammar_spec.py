"""The grammar a request decodes under, as plain data: built by the API process (chat/grammar.py, which
knows the tool-call families), compiled and matched by the engine (engine/grammar.py). Frozen and made of
strings, enums and tuples, so it crosses the process boundary as itself and is its own cache key."""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass


class GrammarKind(enum.Enum):
    TOOLS = "tools"  # tool calls in a family's syntax
    JSON = "json"  # response_format / output_config.format


class CallMode(enum.Enum):
    FORCED = "forced"  # exactly one call of the named tool
    REQUIRED = "required"  # one or more calls, nothing else
    AUTO = "auto"  # free text; a call, once triggered, is schema-bound


class ReasoningMode(enum.Enum):
    NONE = "none"
    INSIDE = "inside"  # the prompt ends inside an open <think>
    OPTIONAL = "optional"  # the model may open a <think> block first


class ArgStyle(enum.Enum):
    JSON = "json"
    QWEN_XML = "qwen_xml"
    GLM_XML = "glm_xml"


@dataclass(frozen=True)
class CallSyntax:
    """How one family writes a call: `prefix name infix ARGS suffix`; `trigger` starts one in free text."""

    prefix: str
    infix: str
    suffix: str
    trigger: str
    style: ArgStyle
    separator: str = "\n"  # between calls when only calls are allowed


@dataclass(frozen=True)
class ToolSchema:
    name: str
    schema_json: str  # the parameters' JSON schema, serialised with sorted keys


@dataclass(frozen=True)
class GrammarSpec:
    kind: GrammarKind
    reasoning: ReasoningMode = ReasoningMode.NONE
    # TOOLS
    mode: CallMode | None = None
    syntax: CallSyntax | None = None
    tools: tuple[ToolSchema, ...] = ()
    parallel: bool = True
    max_calls: int = 4  # calls one REQUIRED turn may make when parallel
    # JSON: None is "any JSON object"
    json_schema: str | None = None


# xgrammar's C++ errors start with a time stamp and its source path ("[12:01:02] /workspace/cpp/
# json_schema_converter.cc:123: ..."): the client needs the reason, not our build's file layout.
_CPP_LOCATION = re.compile(r"(\[[0-9:. ]+\]\s*)?\S*\.(?:cc|cpp|cxx|h|hpp)(?::\d+)+:?\s*")


def plain_grammar_error(e: Exception) -> str:
    """A grammar compiler's exception as a message for the client, without C++ locations or tracebacks."""
    lines = [_CPP_LOCATION.sub("", line).strip() for line in str(e).splitlines()]
    text = " ".join(line for line in lines if line and not line.startswith(("Stack trace", "[bt]", "File ")))
    return text[:500] or type(e).__name__
