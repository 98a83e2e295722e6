"""Split `<think>…</think>` reasoning from the answer, streaming or not.

Reasoning never reaches content (and so never reaches tool-call arguments: the tool parser only sees
content). Templates that end the prompt with `<think>` make the output start inside reasoning.
"""

from __future__ import annotations

from dataclasses import dataclass

from agentbox.chat.harmony import HarmonySplitter
from agentbox.chat.tool_parsers.base import Delta


@dataclass(frozen=True)
class ReasoningStyle:
    name: str
    start: str = "<think>"
    end: str = "</think>"
    always_starts_inside: bool = False  # DeepSeek-R1: the template opens the block; output may lack <think>


REASONING_STYLES: dict[str, ReasoningStyle | None] = {
    "qwen3": ReasoningStyle("qwen3"),
    "deepseek_r1": ReasoningStyle("deepseek_r1", always_starts_inside=True),
    "glm45": ReasoningStyle("glm45"),  # GLM-4.5/4.7: an empty block may be its closer alone (`</think>`)
    # Gemma 4: a thought channel; with thinking off its template closes an empty one at the prompt's end
    "gemma4": ReasoningStyle("gemma4", start="<|channel>thought\n", end="<channel|>"),
    "none": None,
}


def prompt_opens_reasoning(prompt: str, style: str = "qwen3") -> bool:
    """True when the rendered prompt leaves the model inside an open reasoning block."""
    s = REASONING_STYLES.get(style)
    if s is None:
        return False
    tail = prompt.rstrip()
    return tail.endswith(s.start)


class ReasoningSplitter:
    """Feed output text; get Delta(reasoning=…) and Delta(content=…) pieces, markup held back."""

    def __init__(self, style: str = "qwen3", *, starts_inside: bool = False) -> None:
        if style not in REASONING_STYLES:
            raise ValueError(f"unknown reasoning parser {style!r}; known: {', '.join(REASONING_STYLES)}")
        self.style = REASONING_STYLES[style]
        self.buf = ""
        self.inside = self.style is not None and (starts_inside or self.style.always_starts_inside)
        self.opening_allowed = self.style is not None  # an explicit <think> counts only at the very start
        self.done = self.style is None
        self.strip_next = False  # whitespace right after </think> belongs to neither part

    def feed(self, text: str) -> list[Delta]:
        self.buf += text
        return self._drain(final=False)

    def finish(self) -> list[Delta]:
        out = self._drain(final=True)
        if self.buf:
            out.append(Delta(reasoning=self.buf) if self.inside else Delta(content=self.buf))
            self.buf = ""
        return out

    def split(self, text: str) -> tuple[str, str]:
        """Non-streaming: (reasoning, content)."""
        deltas = self.feed(text) + self.finish()
        return "".join(d.reasoning or "" for d in deltas), "".join(d.content or "" for d in deltas)

    def _drain(self, final: bool) -> list[Delta]:
        out: list[Delta] = []
        s = self.style
        while self.buf:
            if s is None or self.done:
                if self.strip_next:
                    self.buf = self.buf.lstrip()
                    if not self.buf:
                        break
                    self.strip_next = False
                out.append(Delta(content=self.buf))
                self.buf = ""
                break
            if self.opening_allowed:
                rest = self.buf.lstrip()
                if rest.startswith(s.start):
                    self.buf = rest[len(s.start) :]
                    self.inside, self.opening_allowed = True, False
                    continue
                if rest.startswith(s.end):  # an empty block written as its closer alone (GLM-4.7): no content
                    self.buf = rest[len(s.end) :]
                    self.inside, self.opening_allowed, self.done, self.strip_next = False, False, True, True
                    continue
                if (s.start.startswith(rest) or s.end.startswith(rest)) and not final:
                    break  # could still be the opener or a lone closer
                self.opening_allowed = False
                self.done = not self.inside
                continue
            # inside reasoning: look for the end tag
            i = self.buf.find(s.end)
            if i >= 0:
                if i:
                    out.append(Delta(reasoning=self.buf[:i]))
                self.buf = self.buf[i + len(s.end) :]
                self.inside, self.done, self.strip_next = False, True, True
                continue
            keep = 0 if final else _partial_suffix(self.buf, s.end)
            if len(self.buf) > keep:
                out.append(Delta(reasoning=self.buf[: len(self.buf) - keep]))
                self.buf = self.buf[len(self.buf) - keep :]
            break
        return out


def _partial_suffix(text: str, tag: str) -> int:
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


# Formats whose reasoning is not a tag pair but a channel: their own splitter, same interface.
HARMONY_STYLES = ("harmony", "openai_gptoss")


def get_reasoning_splitter(name: str | None, *, starts_inside: bool = False) -> ReasoningSplitter | HarmonySplitter:
    if name in HARMONY_STYLES:
        return HarmonySplitter()
    return ReasoningSplitter(name or "none", starts_inside=starts_inside)
