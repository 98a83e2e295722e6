"""The shared shape of every tool-call parser: deltas, parsed output, and one streaming driver.

A family only says how to find its opener and how far a call block has been parsed; the driver turns
that into OpenAI-shaped deltas. The non-streaming `parse` runs the same driver over the whole text, so a
stream split anywhere yields exactly what the one-shot parse yields (the property the tests check).
"""

from __future__ import annotations

import json
import secrets
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass
class ToolCallDelta:
    index: int
    id: str | None = None  # set on the first delta of a call only
    name: str | None = None  # likewise
    arguments: str = ""

    def to_openai(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index}
        fn: dict[str, Any] = {"arguments": self.arguments}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
        if self.name is not None:
            fn["name"] = self.name
        out["function"] = fn
        return out


@dataclass
class Delta:
    """One streamed piece: content text, reasoning text, or a piece of one tool call."""

    content: str | None = None
    reasoning: str | None = None
    tool_call: ToolCallDelta | None = None

    def to_openai(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.content is not None:
            out["content"] = self.content
        if self.reasoning is not None:
            # Clients read one name or the other (vLLM-style vs OpenRouter-style); send both.
            out["reasoning_content"] = out["reasoning"] = self.reasoning
        if self.tool_call is not None:
            out["tool_calls"] = [self.tool_call.to_openai()]
        return out


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedOutput:
    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass
class CallProgress:
    """How much of one call a family could read so far. `arguments` only ever grows by appending."""

    name: str | None = None
    arguments: str = ""
    done: bool = False


@dataclass
class BlockProgress:
    calls: list[CallProgress]
    end: int | None = None  # index in the block text just past the block, once it is closed


def collect(deltas: list[Delta]) -> ParsedOutput:
    """Fold a delta stream back into one message (used by `parse` and by tests)."""
    content: list[str] = []
    calls: dict[int, ToolCall] = {}
    for d in deltas:
        if d.content:
            content.append(d.content)
        tc = d.tool_call
        if tc is not None:
            call = calls.setdefault(tc.index, ToolCall(id="", name="", arguments=""))
            call.id = tc.id or call.id
            call.name = tc.name or call.name
            call.arguments += tc.arguments
    return ParsedOutput("".join(content), [calls[i] for i in sorted(calls)])


class ToolParser(ABC):
    """Base of every family. Subclasses set `openers` and implement `parse_block`."""

    name = ""
    openers: tuple[str, ...] = ()

    def __init__(self, tools: list[dict] | None = None) -> None:
        self.tools = tools or []

    # ---- family hooks -------------------------------------------------------------------------
    def find_opener(self, text: str, at_start: bool) -> tuple[int, int] | None:
        """(index, length) of the earliest opener in text; `at_start`: text begins the output."""
        best: tuple[int, int] | None = None
        for op in self.openers:
            i = text.find(op)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, len(op))
        return best

    def holdback(self, text: str, at_start: bool) -> int:
        """How many trailing chars might still become an opener (never shown as content yet)."""
        keep = 0
        for op in self.openers:
            for n in range(min(len(op) - 1, len(text)), 0, -1):
                if text.endswith(op[:n]):
                    keep = max(keep, n)
                    break
        return keep

    @abstractmethod
    def parse_block(self, text: str, final: bool) -> BlockProgress:
        """Parse one call block from its opener on (each family has its own syntax)."""

    # ---- the public API ----------------------------------------------------------------------
    def stream(self) -> ToolStream:
        return ToolStream(self)

    def parse(self, text: str) -> ParsedOutput:
        s = self.stream()
        return collect(s.feed(text) + s.finish())

    def param_schema(self, function: str, param: str) -> dict | None:
        """The JSON schema of one parameter when the request's tools declare it."""
        for tool in self.tools:
            fn = tool.get("function", tool)
            if fn.get("name") == function:
                props = (fn.get("parameters") or {}).get("properties") or {}
                spec = props.get(param)
                return spec if isinstance(spec, dict) else None
        return None

    def convert_value(self, function: str, param: str, raw: str) -> Any:
        """XML formats carry text; convert it to the schema's type (kept a string without a schema).

        Whitespace around a value is kept for free strings (code edits depend on it) and dropped where
        it cannot be part of the value: numbers, booleans, JSON, enum members.
        """
        spec = self.param_schema(function, param)
        if spec is None:
            return raw
        if "enum" in spec:
            for candidate in (raw, raw.strip()):
                if candidate in spec["enum"]:
                    return candidate
            try:
                value = json.loads(raw)
                return value if value in spec["enum"] else raw
            except ValueError:
                return raw
        t = spec.get("type")
        if isinstance(t, list):
            t = next((x for x in t if x != "null"), None)
        if t in (None, "string"):
            return raw
        try:
            value = json.loads(raw)
        except ValueError:
            if t == "boolean" and raw.strip().lower() in ("true", "false"):
                return raw.strip().lower() == "true"
            return raw
        if t == "integer" and isinstance(value, float) and value.is_integer():
            return int(value)
        return value


class ToolStream:
    """Feed text deltas; get content and tool-call deltas. Partial markup is held back, never shown."""

    def __init__(self, parser: ToolParser) -> None:
        self.p = parser
        self.buf = ""
        self.in_block = False
        self.at_start = True  # nothing but whitespace seen yet
        self.after_call = False  # drop whitespace that only separates calls
        self.next_index = 0
        self.block_calls: list[tuple[int, int]] = []  # per call in the open block: (index, args emitted)
        self.block_opener = ""
        self.any_call = False

    @property
    def has_tool_calls(self) -> bool:
        """True once a call was emitted: the turn's finish_reason is then `tool_calls`."""
        return self.any_call

    def feed(self, text: str) -> list[Delta]:
        self.buf += text
        return self._drain(final=False)

    def finish(self) -> list[Delta]:
        out = self._drain(final=True)
        if self.in_block:
            out += self._block(final=True, force=True)
        elif self.buf:
            tail = self.buf.rstrip() if self.any_call else self.buf
            if tail:
                out.append(Delta(content=tail))
            self.buf = ""
        return out

    def _drain(self, final: bool) -> list[Delta]:
        out: list[Delta] = []
        while True:
            if self.in_block:
                got = self._block(final=final)
                out += got
                if self.in_block:
                    return out
                continue
            if self.after_call:
                stripped = self.buf.lstrip()
                self.buf = stripped
                if not stripped:
                    return out
            hit = self.p.find_opener(self.buf, self.at_start)
            if hit is not None:
                i, n = hit
                before = self.buf[:i].rstrip()
                if before:
                    out.append(Delta(content=before))
                # The whitespace before a call is dropped; kept with the opener in case it is no call.
                self.block_opener = self.buf[len(before) : i + n]
                self.buf = self.buf[i + n :]
                self.in_block = True
                self.block_calls = []
                self.at_start = False
                continue
            if final:
                return out
            keep = self.p.holdback(self.buf, self.at_start)
            # Trailing whitespace is held too: it may only separate content from a call.
            body = self.buf[: len(self.buf) - keep]
            ws = len(body) - len(body.rstrip())
            emit = body[: len(body) - ws]
            if emit:
                out.append(Delta(content=emit))
                self.after_call = False
                self.at_start = False
            self.buf = self.buf[len(emit) :]
            return out

    def _block(self, final: bool, force: bool = False) -> list[Delta]:
        prog = self.p.parse_block(self.buf, final)
        out: list[Delta] = []
        for k, call in enumerate(prog.calls):
            if call.name is None:
                break
            if k == len(self.block_calls):
                idx = self.next_index
                self.next_index += 1
                self.block_calls.append((idx, 0))
                out.append(Delta(tool_call=ToolCallDelta(idx, new_call_id(), call.name, "")))
                self.any_call = True
            idx, sent = self.block_calls[k]
            args = call.arguments
            if (call.done or force) and not args:
                args = "{}"
            if len(args) > sent:
                out.append(Delta(tool_call=ToolCallDelta(idx, None, None, args[sent:])))
                self.block_calls[k] = (idx, len(args))
        if prog.end is not None or force:
            end = prog.end if prog.end is not None else len(self.buf)
            if not self.block_calls:
                # Not a call after all (malformed): the text goes back to the user, not into the void.
                raw = self.block_opener + self.buf[:end]
                if raw:
                    out.append(Delta(content=raw))
            self.buf = self.buf[end:]
            self.in_block = False
            self.after_call = bool(self.block_calls)
        return out


def json_value_end(s: str, i: int) -> int | None:
    """Index just past the JSON value starting at s[i] (after whitespace), or None if incomplete."""
    n = len(s)
    while i < n and s[i] in " \t\r\n":
        i += 1
    if i >= n:
        return None
    c = s[i]
    if c == '"':
        j = i + 1
        while j < n:
            if s[j] == "\\":
                j += 2
                continue
            if s[j] == '"':
                return j + 1
            j += 1
        return None
    if c in "{[":
        depth = 0
        j = i
        in_str = False
        while j < n:
            ch = s[j]
            if in_str:
                if ch == "\\":
                    j += 1
                elif ch == '"':
                    in_str = False
            elif ch == '"':
                in_str = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < n and s[j] not in ",}] \t\r\n":
        j += 1
    return j if j < n else None  # a bare literal is complete only once something follows it


def skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in " \t\r\n":
        i += 1
    return i


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)
