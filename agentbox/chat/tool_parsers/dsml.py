"""DeepSeek-V3.2 / V4's DSML tool calls: one block of invocations, each parameter a tagged value that says whether
it is a string (as is) or JSON (a number, a boolean, an array, an object):

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="read_file">
    <｜DSML｜parameter name="path" string="true">src/a.py</｜DSML｜parameter>
    <｜DSML｜parameter name="lines" string="false">40</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

V3.2 names the block `function_calls`, V4 `tool_calls`; both are read. The template writes a call back with the
same tags, one parameter a line in the arguments' order, so a parsed call renders as the model wrote it.
"""

from __future__ import annotations

import json
from typing import Any

from agentbox.chat.tool_parsers.base import BlockProgress, CallProgress, ToolParser, skip_ws
from agentbox.chat.tool_parsers.xml_family import args_text

DSML = "｜DSML｜"
BLOCKS = ("tool_calls", "function_calls")
INVOKE, PARAM = f'<{DSML}invoke name="', f'<{DSML}parameter name="'
END_INVOKE, END_PARAM = f"</{DSML}invoke>", f"</{DSML}parameter>"


class DsmlParser(ToolParser):
    name = "deepseek_v4"
    openers = tuple(f"<{DSML}{b}>" for b in BLOCKS)

    def parse_block(self, text: str, final: bool) -> BlockProgress:
        calls: list[CallProgress] = []
        i = 0
        while True:
            i = skip_ws(text, i)
            if text.startswith(INVOKE, i):
                j = text.find('">', i + len(INVOKE))
                if j < 0:
                    break
                call = CallProgress(name=text[i + len(INVOKE) : j])
                calls.append(call)
                i = self._params(text, j + 2, call)
                if not call.done:
                    break
                continue
            closer = next((f"</{DSML}{b}>" for b in BLOCKS if text.startswith(f"</{DSML}{b}>", i)), None)
            if closer is not None:
                return BlockProgress(calls, i + len(closer))
            break
        return BlockProgress(calls, len(text) if final else None)

    def _params(self, text: str, i: int, call: CallProgress) -> int:
        """Reads the call's parameters from i; returns where reading stopped (past its closer once done)."""
        pairs: list[tuple[str, Any]] = []
        while True:
            i = skip_ws(text, i)
            if text.startswith(PARAM, i):
                k = text.find('"', i + len(PARAM))
                head_end = text.find('">', k) if k >= 0 else -1
                close = text.find(END_PARAM, head_end) if head_end >= 0 else -1
                if close < 0:
                    break
                key = text[i + len(PARAM) : k]
                is_string = 'string="true"' in text[k:head_end]
                pairs.append((key, self._value(call.name or "", key, text[head_end + 2 : close], is_string)))
                i = close + len(END_PARAM)
                continue
            if text.startswith(END_INVOKE, i):
                call.done = True
                call.arguments = args_text(pairs, True)
                return i + len(END_INVOKE)
            break
        call.arguments = args_text(pairs, False)
        return i

    def _value(self, function: str, key: str, raw: str, is_string: bool) -> Any:
        if is_string:
            return raw
        try:
            return json.loads(raw)
        except ValueError:
            return self.convert_value(function, key, raw)
