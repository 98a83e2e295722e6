"""Incremental tokenization of a growing conversation: a warm turn tokenizes only what it appended.

An agent's turn N+1 renders to turn N's prompt plus a few new messages (render.py keeps rendering
prefix-stable). Tokenizing the whole 128k-token text again took ~300 ms; the new part is tens of tokens.

Why the ids equal full tokenization: a Hugging Face tokenizer first cuts the text at every added token
(`<|im_start|>`, `<|im_end|>`, harmony's `<|start|>` ...) and tokenizes the pieces between them
independently. So right after an added token is a boundary no token crosses: ids(text) = ids(text[:c]) +
ids(text[c:]) when c ends an added token. We keep, per conversation, the text, its ids and those boundaries
(character offset, token count); a new text that shares a prefix with a kept one reuses the ids up to the
last boundary inside the shared prefix and tokenizes the rest. A changed prefix (an edited message,
reasoning a template drops) just moves the boundary back; nothing shared is full tokenization.

Added tokens that strip whitespace on their right (`rstrip`) do not give a boundary (the whitespace after
them belongs to them), and a tokenizer for which a probe shows pieces do not compose (a normaliser or a
pre-tokenizer that treats a text's start specially) is tokenized in full every time.

No session id is needed: a new text is matched against the kept texts (a `startswith` each, which stops at
the first differing character), so it also works for clients that send none.
"""

from __future__ import annotations

import bisect
import re
import weakref
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from agentbox.prefix import common_prefix


@dataclass
class Tokenized:
    """A text, its ids, and the boundaries after added tokens as (character offset, ids before it)."""

    text: str
    ids: array  # of int32 ids: a quarter of a list's memory
    cuts: list[int] = field(default_factory=list)  # character offsets, ascending (0 is implicit)
    counts: list[int] = field(default_factory=list)  # ids in text[:cut], per cut

    def boundary_at_most(self, chars: int) -> tuple[int, int]:
        """The last boundary at or before `chars`: (character offset, ids before it)."""
        k = bisect.bisect_right(self.cuts, chars)
        return (self.cuts[k - 1], self.counts[k - 1]) if k else (0, 0)


class IncrementalTokenizer:
    """`encode(text)` equal to `tokenizer.encode(text, add_special_tokens=False)`, reusing the ids of the
    longest kept text sharing a prefix with it. Not thread-safe (the server tokenizes on one thread)."""

    def __init__(self, tokenizer: Any, max_texts: int) -> None:
        self.tok = tokenizer
        self.max_texts = max_texts
        self.kept: OrderedDict[int, Tokenized] = OrderedDict()  # id(entry) -> entry, least recent first
        self.reused_tokens = 0  # counters: ids taken from a kept text, ids tokenized
        self.tokenized_tokens = 0
        added = [t for t in tokenizer.added_tokens_decoder.values() if t.content]
        self._cut = re.compile("|".join(re.escape(t.content) for t in sorted(added, key=lambda t: -len(t.content))
                                        if not t.rstrip and not t.single_word)) if added else None
        self.enabled = self._cut is not None and self._pieces_compose(added)

    def copy(self) -> IncrementalTokenizer:
        """A twin with the same kept texts (benchmarks time one encode from the same state repeatedly)."""
        twin = object.__new__(IncrementalTokenizer)
        twin.__dict__.update(self.__dict__)
        twin.kept = OrderedDict(self.kept)
        return twin

    def _full(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def _pieces_compose(self, added: list[Any]) -> bool:
        """Whether ids(a + b) == ids(a) + ids(b) when a ends with an added token, on probes that catch
        normalisers and start-of-text rules (SentencePiece's leading '▁', a lowercaser)."""
        for t in added[:4]:
            for tail in (" Hello world", "Hello\n\n  x", "\n", "é ü 中文 x", "  "):
                a = "A b" + t.content
                if self._full(a + tail) != self._full(a) + self._full(tail):
                    return False
        return True

    def encode(self, text: str) -> list[int]:
        return self.encode_ids(text).tolist()

    def encode_ids(self, text: str) -> array:
        """`encode` as an int32 array, the kept ids copied at C speed: the server sends these on as they are
        (engine/ipc/prompt_delta.py), where a list of 121k ids took ~1.7 ms to build and as long to compare."""
        if not self.enabled:
            return array("i", self._full(text))
        base, shared = self._best(text)
        cut, before = base.boundary_at_most(shared) if base is not None else (0, 0)
        if base is not None and shared == len(base.text):
            self.kept.pop(id(base), None)  # the new text continues this one: it takes its place
        # Otherwise base stays: a text that only shares a head with it (another conversation: every chat starts
        # with the same added token, often the same system part) took its place, and two sessions taking turns
        # then tokenized their whole text every turn (~330 ms at 128k tokens).
        new = self._extend(base, cut, before, text)
        self.kept[id(new)] = new
        while len(self.kept) > self.max_texts:
            self.kept.popitem(last=False)
        return array("i", new.ids)  # a copy: the kept ids stay this text's

    def _best(self, text: str) -> tuple[Tokenized | None, int]:
        """The kept text sharing the longest prefix with `text`, and that length."""
        best, shared = None, 0
        for entry in reversed(self.kept.values()):  # most recent first: a continuing session is found at once
            if text.startswith(entry.text):
                if len(entry.text) > shared:
                    best, shared = entry, len(entry.text)
                continue
            if len(entry.text) <= shared:
                continue
            n = common_prefix(entry.text, text)
            if n > shared:
                best, shared = entry, n
        return best, shared

    def _extend(self, base: Tokenized | None, cut: int, before: int, text: str) -> Tokenized:
        """`base`'s ids up to its boundary `cut`, then the rest of `text` tokenized piece by piece (cut after
        each added token) so the new text's boundaries are known too."""
        assert self._cut is not None
        ids = base.ids[:before] if base is not None else array("i")
        k = bisect.bisect_right(base.cuts, cut) if base is not None else 0
        cuts = base.cuts[:k] if base is not None else []
        counts = base.counts[:k] if base is not None else []
        self.reused_tokens += len(ids)
        rest = text[cut:]
        ends = [m.end() for m in self._cut.finditer(rest)]
        starts = [0, *ends]
        pieces = [rest[s:e] for s, e in zip(starts, [*ends, len(rest)], strict=True)]
        encoded = self.tok(pieces, add_special_tokens=False)["input_ids"] if len(pieces) > 1 else [self._full(rest)]
        for j, piece_ids in enumerate(encoded):
            ids.extend(piece_ids)
            self.tokenized_tokens += len(piece_ids)
            if j < len(ends):
                cuts.append(cut + ends[j])
                counts.append(len(ids))
        return Tokenized(text, ids, cuts, counts)


_by_tokenizer: weakref.WeakKeyDictionary[Any, IncrementalTokenizer] = weakref.WeakKeyDictionary()


def incremental_for(tokenizer: Any, max_texts: int) -> IncrementalTokenizer:
    """The server's one incremental tokenizer per tokenizer (made on first use)."""
    inc = _by_tokenizer.get(tokenizer)
    if inc is None:
        inc = _by_tokenizer[tokenizer] = IncrementalTokenizer(tokenizer, max_texts)
    return inc
