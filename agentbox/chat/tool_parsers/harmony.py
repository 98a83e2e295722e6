"""gpt-oss (harmony) tool calls, as `chat.harmony.HarmonySplitter` leaves them in content:
`to=functions.NAME<|message|>ARGS<|call|>` (ARGS: the model's JSON text, streamed as written)."""

from __future__ import annotations

from agentbox.chat.tool_parsers.base import BlockProgress, CallProgress, ToolParser

MESSAGE, CALL = "<|message|>", "<|call|>"
CALL_OPENER = "to=functions."


def partial_suffix(text: str, tags: tuple[str, ...]) -> int:
    """How many trailing chars of text could be the start of one of tags."""
    keep = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), 0, -1):
            if text.endswith(tag[:n]):
                keep = max(keep, n)
                break
    return keep


class HarmonyToolParser(ToolParser):
    """Reads the normalised calls `HarmonySplitter` leaves in content: `to=functions.NAME<|message|>ARGS<|call|>`."""

    name = "openai"
    openers = (CALL_OPENER,)

    def parse_block(self, text: str, final: bool) -> BlockProgress:
        i = text.find(MESSAGE)
        if i < 0:
            return BlockProgress([], end=len(text) if final else None)
        call = CallProgress(name=text[:i].strip())
        body = text[i + len(MESSAGE) :]
        j = body.find(CALL)
        if j >= 0:
            call.arguments, call.done = body[:j].strip(), True
            return BlockProgress([call], end=i + len(MESSAGE) + j + len(CALL))
        keep = 0 if final else partial_suffix(body, (CALL,))
        # Leading whitespace is dropped once something follows it; arguments only ever grow by appending.
        call.arguments = body[: len(body) - keep].lstrip()
        call.done = final
        return BlockProgress([call], end=len(text) if final else None)
