"""Incremental detokenization and stop strings, in the API process (the engine only sees token ids)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class Detokenizer:
    """Emits text as tokens arrive, holding back an incomplete UTF-8 sequence (shown as U+FFFD) until the
    next token completes it. Decodes a short window, not the whole output, so cost stays per token."""

    def __init__(self, tokenizer: Any, prompt_tail: Sequence[int] | None = None, skip_special_tokens: bool = True,
                 hidden_ids: frozenset[int] | None = None) -> None:
        self.tok = tokenizer
        self.skip = skip_special_tokens  # False for harmony (gpt-oss): its channel markup is special tokens
        self.hidden = hidden_ids or frozenset()  # never shown (Gemma 4: the special tokens its parsers do not read)
        self.ids: list[int] = list(prompt_tail[-4:]) if prompt_tail else []  # the tail only: not a copy of 121k ids
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def add(self, token_ids: list[int]) -> str:
        self.ids.extend(t for t in token_ids if t not in self.hidden)
        prefix = self.tok.decode(self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=self.skip)
        full = self.tok.decode(self.ids[self.prefix_offset :], skip_special_tokens=self.skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return full[len(prefix) :]
        return ""

    def flush(self) -> str:
        prefix = self.tok.decode(self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=self.skip)
        full = self.tok.decode(self.ids[self.prefix_offset :], skip_special_tokens=self.skip)
        self.read_offset = self.prefix_offset = len(self.ids)
        return full[len(prefix) :] if len(full) > len(prefix) else ""


class StopChecker:
    """Finds stop strings in streamed text. Holds back the tail that could still begin a stop string, so a
    stop string split across tokens never reaches the client."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.buf = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """Returns the text safe to emit now; sets `stopped` when a stop string appeared."""
        if not self.stops:
            return text
        self.buf += text
        cut = min((i for i in (self.buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            out, self.buf, self.stopped = self.buf[:cut], "", True
            return out
        if self.hold and len(self.buf) > self.hold:
            out, self.buf = self.buf[: -self.hold], self.buf[-self.hold :]
            return out
        if not self.hold:
            out, self.buf = self.buf, ""
            return out
        return ""

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out
