"""Gemma 4's tool calls: `<|tool_call>call:NAME{key:value,...}<tool_call|>`, as its chat template renders them.

Values are Gemma's own notation, not JSON: strings between `<|"|>` quote tokens (nothing inside is escaped),
bare numbers, true / false / null, `[a,b]` and `{k:v}` with bare keys (or quoted with `<|"|>`). A call's
arguments are sent whole once its closing `}` is read (the notation has no prefix that is valid JSON).
"""

from __future__ import annotations

import json
from typing import Any

from agentbox.chat.tool_parsers.base import BlockProgress, CallProgress, ToolParser

QUOTE = '<|"|>'
CLOSE = "<tool_call|>"
_BARE_END = ",}]"


class _Incomplete(Exception):
    """The text ends inside a value: wait for more (or, at the end of output, give up on the call)."""


def _value(text: str, i: int) -> tuple[Any, int]:
    """The value starting at text[i] and the index just past it."""
    if text.startswith(QUOTE, i):
        j = text.find(QUOTE, i + len(QUOTE))
        if j < 0:
            raise _Incomplete
        return text[i + len(QUOTE) : j], j + len(QUOTE)
    if i >= len(text):
        raise _Incomplete
    if text[i] == "{":
        return _object(text, i)
    if text[i] == "[":
        items: list[Any] = []
        i += 1
        while True:
            if i >= len(text):
                raise _Incomplete
            if text[i] == "]":
                return items, i + 1
            item, i = _value(text, i)
            items.append(item)
            if i < len(text) and text[i] == ",":
                i += 1
    j = i
    while j < len(text) and text[j] not in _BARE_END:
        j += 1
    if j >= len(text):
        raise _Incomplete
    return _bare(text[i:j].strip()), j


def _bare(word: str) -> Any:
    """true / false / null / a number; anything else stays the text it is (a model's unquoted string)."""
    if word in ("true", "false", "null"):
        return {"true": True, "false": False, "null": None}[word]
    try:
        return json.loads(word)
    except ValueError:
        return word


def _object(text: str, i: int) -> tuple[dict[str, Any], int]:
    """`{k:v,...}` from text[i] == "{"."""
    out: dict[str, Any] = {}
    i += 1
    while True:
        if i >= len(text):
            raise _Incomplete
        if text[i] == "}":
            return out, i + 1
        if text.startswith(QUOTE, i):
            key, i = _value(text, i)
        else:
            j = text.find(":", i)
            if j < 0:
                raise _Incomplete
            key, i = text[i:j].strip(), j
        if not text.startswith(":", i):
            raise _Incomplete
        out[str(key)], i = _value(text, i + 1)
        if i < len(text) and text[i] == ",":
            i += 1


class Gemma4Parser(ToolParser):
    name = "gemma4"
    openers = ("<|tool_call>",)

    def parse_block(self, text: str, final: bool) -> BlockProgress:
        """text: from just past `<|tool_call>`."""
        incomplete = BlockProgress([], len(text) if final else None)
        if not text.startswith("call:"):
            return incomplete
        brace = text.find("{")
        if brace < 0:
            return incomplete
        call = CallProgress(name=text[len("call:") : brace].strip())
        try:
            args, end = _object(text, brace)
        except _Incomplete:
            return BlockProgress([call], len(text) if final else None)
        call.arguments, call.done = json.dumps(args, ensure_ascii=False), True
        if text.startswith(CLOSE, end):
            return BlockProgress([call], end + len(CLOSE))
        if CLOSE.startswith(text[end:]) and not final:
            return BlockProgress([call], None)  # the closing token may still come
        return BlockProgress([call], end)
