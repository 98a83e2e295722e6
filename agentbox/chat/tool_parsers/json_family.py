"""Families whose calls are JSON objects: hermes / Qwen2.5, Llama-3 JSON, Mistral [TOOL_CALLS]."""

from __future__ import annotations

import json

from agentbox.chat.tool_parsers.base import BlockProgress, CallProgress, ToolParser, json_value_end, skip_ws

NAME_KEYS = ("name",)
ARG_KEYS = ("arguments", "parameters")


def parse_json_call(s: str, i: int) -> tuple[CallProgress, int | None]:
    """Read `{"name": ..., "arguments": {...}}` from s[i] as far as it goes; (progress, end or None).

    Arguments are streamed as the model's own JSON text, so every prefix is a prefix of the final text.
    """
    call = CallProgress()
    i = skip_ws(s, i)
    if i >= len(s):
        return call, None
    if s[i] != "{":
        return call, i  # not a call object: the caller decides what to do
    i += 1
    while True:
        i = skip_ws(s, i)
        if i >= len(s):
            return call, None
        if s[i] == "}":
            call.done = call.name is not None
            return call, i + 1
        if s[i] == ",":
            i += 1
            continue
        kend = json_value_end(s, i)
        if kend is None or s[i] != '"':
            return call, None if kend is None else kend
        key = json.loads(s[i:kend])
        i = skip_ws(s, kend)
        if i >= len(s):
            return call, None
        if s[i] != ":":
            return call, i
        v = skip_ws(s, i + 1)
        vend = json_value_end(s, v)
        if key in ARG_KEYS and v < len(s) and s[v] == "{":
            call.arguments = s[v:vend] if vend is not None else s[v:]
            if vend is None:
                return call, None
        elif vend is None:
            return call, None
        elif key in NAME_KEYS:
            call.name = str(json.loads(s[v:vend]))
        elif key in ARG_KEYS:
            value = json.loads(s[v:vend])
            # Some models send arguments as a JSON string; keep it only when it holds an object.
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError:
                    value = None
            call.arguments = json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else ""
        i = vend


class HermesParser(ToolParser):
    """`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (Hermes, Qwen2.5, Qwen3)."""

    name = "hermes"
    openers = ("<tool_call>",)
    closer = "</tool_call>"

    def parse_block(self, text: str, final: bool) -> BlockProgress:
        call, end = parse_json_call(text, 0)
        if end is None:
            return BlockProgress([call], len(text) if final else None)
        j = skip_ws(text, end)
        rest = text[j:]
        if rest.startswith(self.closer):
            return BlockProgress([call], j + len(self.closer))
        if self.closer.startswith(rest) and not final:
            return BlockProgress([call], None)
        return BlockProgress([call], end)


class Llama3JsonParser(ToolParser):
    """`{"name": ..., "parameters": {...}}`, alone or after `<|python_tag|>`, several joined by `;`."""

    name = "llama3_json"
    openers = ("<|python_tag|>",)
    start_opener = '{"name"'

    def find_opener(self, text: str, at_start: bool) -> tuple[int, int] | None:
        if at_start:
            j = skip_ws(text, 0)
            if text[j:].startswith(self.start_opener):
                return j, 0
        return super().find_opener(text, at_start)

    def holdback(self, text: str, at_start: bool) -> int:
        if at_start:
            rest = text[skip_ws(text, 0) :]
            if rest and self.start_opener.startswith(rest):
                return len(text)
        return super().holdback(text, at_start)

    def parse_block(self, text: str, final: bool) -> BlockProgress:
        calls: list[CallProgress] = []
        i = 0
        while True:
            call, end = parse_json_call(text, i)
            calls.append(call)
            if end is None:
                return BlockProgress(calls, len(text) if final else None)
            j = skip_ws(text, end)
            if j >= len(text) and not final:
                return BlockProgress(calls, None)  # a `;` and another call may follow
            if j < len(text) and text[j] == ";":
                i = j + 1
                continue
            return BlockProgress(calls, end)


class MistralParser(ToolParser):
    """`[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` and the newer `[TOOL_CALLS]name[ARGS]{...}`."""

    name = "mistral"
    openers = ("[TOOL_CALLS]",)
    args_tag = "[ARGS]"

    def parse_block(self, text: str, final: bool) -> BlockProgress:
        i = skip_ws(text, 0)
        if i >= len(text):
            return BlockProgress([], len(text) if final else None)
        if text[i] == "[":
            return self._array(text, i + 1, final)
        k = text.find(self.args_tag, i)
        if k < 0:
            return BlockProgress([], len(text) if final else None)
        call = CallProgress(name=text[i:k].strip())
        v = k + len(self.args_tag)
        vend = json_value_end(text, v)
        call.arguments = text[skip_ws(text, v) : vend if vend is not None else len(text)]
        if vend is None:
            return BlockProgress([call], len(text) if final else None)
        call.done = True
        return BlockProgress([call], vend)

    def _array(self, text: str, i: int, final: bool) -> BlockProgress:
        calls: list[CallProgress] = []
        while True:
            call, end = parse_json_call(text, i)
            calls.append(call)
            if end is None:
                return BlockProgress(calls, len(text) if final else None)
            j = skip_ws(text, end)
            if j >= len(text):
                return BlockProgress(calls, len(text) if final else None)
            if text[j] == ",":
                i = j + 1
                continue
            return BlockProgress(calls, j + 1 if text[j] == "]" else end)
