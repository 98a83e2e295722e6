"""Families whose calls are XML-ish tags with text values: Qwen3-Coder and GLM-4.5/4.7.

Values arrive as text; they are converted to the tool schema's types. Arguments stream one finished
parameter at a time, so every prefix is a prefix of the final `json.dumps(arguments)`.
"""

from __future__ import annotations

from typing import Any

from agentbox.chat.tool_parsers.base import BlockProgress, CallProgress, ToolParser, dumps, skip_ws


def args_text(pairs: list[tuple[str, Any]], done: bool) -> str:
    parts = [("{" if k == 0 else ", ") + dumps(key) + ": " + dumps(v) for k, (key, v) in enumerate(pairs)]
    if done:
        parts.append("}" if pairs else "{}")
    return "".join(parts)


def _waiting(rest: str, *tags: str) -> bool:
    """True when `rest` could still grow into one of the tags."""
    return any(t.startswith(rest) for t in tags)


VALUE_FOLLOWERS = ("<parameter=", "</function>", "</tool_call>")


def _value_end(text: str, start: int, final: bool) -> tuple[int, int]:
    """Where a Qwen3-Coder value ends and how much closing markup to skip; (-1, 0) while undecided.

    A value is text, and agents' values hold markup (an edit of this parser, an HTML file): `</parameter>` ends it
    only where the next tag follows, and `<parameter=` inside a line is text. The model sometimes drops
    `</parameter>`; in a call that has ended (`</function>` seen, or the output is over), a `<parameter=` or
    `</function>` at the start of a line then ends the value.
    """
    at = start
    while (close := text.find("</parameter>", at)) >= 0:
        after = skip_ws(text, close + len("</parameter>"))
        rest = text[after:]
        if rest.startswith(VALUE_FOLLOWERS) or (final and not rest):
            return close, len("</parameter>")
        if not final and _waiting(rest, *VALUE_FOLLOWERS):
            return -1, 0  # what follows could still be the next tag
        at = close + 1
    if not final and text.find("</function>", start) < 0:
        return -1, 0
    ends = [p for p in (text.find("\n<parameter=", start), text.find("\n</function>", start)) if p >= 0]
    return (min(ends) + 1, 0) if ends else (-1, 0)


class Qwen3CoderParser(ToolParser):
    """`<tool_call>\\n<function=name>\\n<parameter=p>\\nvalue\\n</parameter>\\n</function>\\n</tool_call>`."""

    name = "qwen3_coder"
    openers = ("<tool_call>",)

    def parse_block(self, text: str, final: bool) -> BlockProgress:
        incomplete = BlockProgress([], len(text) if final else None)
        i = skip_ws(text, 0)
        fn = "<function="
        if not text.startswith(fn, i):
            return incomplete
        j = text.find(">", i)
        if j < 0:
            return incomplete
        call = CallProgress(name=text[i + len(fn) : j].strip())
        pairs: list[tuple[str, Any]] = []
        i = j + 1
        while True:
            i = skip_ws(text, i)
            rest = text[i:]
            if rest.startswith("<parameter="):
                k = text.find(">", i)
                close, skip = _value_end(text, k + 1, final) if k >= 0 else (-1, 0)
                if close < 0:
                    break
                key = text[i + len("<parameter=") : k].strip()
                raw = text[k + 1 : close]
                raw = raw[1:] if raw.startswith("\n") else raw
                raw = raw[:-1] if raw.endswith("\n") else raw
                pairs.append((key, self.convert_value(call.name, key, raw)))
                i = close + skip
                continue
            if rest.startswith("</function>"):
                call.done = True
                call.arguments = args_text(pairs, True)
                j = skip_ws(text, i + len("</function>"))
                tail = text[j:]
                if tail.startswith("</tool_call>"):
                    return BlockProgress([call], j + len("</tool_call>"))
                if _waiting(tail, "</tool_call>") and not final:
                    return BlockProgress([call], None)
                return BlockProgress([call], i + len("</function>"))
            break
        call.arguments = args_text(pairs, False)
        return BlockProgress([call], len(text) if final else None)


class Glm45Parser(ToolParser):
    """`<tool_call>name\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>\\n</tool_call>` (GLM-4.5/4.6/4.7;
    4.7 drops the newlines, and a zero-argument call is `<tool_call>name</tool_call>`)."""

    name = "glm45"
    openers = ("<tool_call>",)

    def parse_block(self, text: str, final: bool) -> BlockProgress:
        ends = [p for p in (text.find("\n"), text.find("<arg_key>"), text.find("</tool_call>")) if p >= 0]
        if not ends:
            name = text.strip()
            if final and name:
                return BlockProgress([CallProgress(name=name, arguments="{}", done=True)], len(text))
            return BlockProgress([], len(text) if final else None)
        j = min(ends)
        call = CallProgress(name=text[:j].strip())
        pairs: list[tuple[str, Any]] = []
        i = j
        while True:
            i = skip_ws(text, i)
            rest = text[i:]
            if rest.startswith("<arg_key>"):
                k = text.find("</arg_key>", i)
                v = text.find("<arg_value>", k) if k >= 0 else -1
                close = text.find("</arg_value>", v) if v >= 0 else -1
                if close < 0:
                    break
                key = text[i + len("<arg_key>") : k].strip()
                raw = text[v + len("<arg_value>") : close]
                pairs.append((key, self.convert_value(call.name, key, raw)))
                i = close + len("</arg_value>")
                continue
            if rest.startswith("</tool_call>"):
                call.done = True
                call.arguments = args_text(pairs, True)
                return BlockProgress([call], i + len("</tool_call>"))
            break
        call.arguments = args_text(pairs, False)
        return BlockProgress([call], len(text) if final else None)
