"""A memo of recently decoded request bodies, so that a warm agent turn decodes only what it appended.

An agent re-sends its whole conversation every turn (0.63 MB of JSON at 128k tokens, 634 messages), and the
guard decoded all of it (orjson, 0.5 ms on this Xeon) and walked it for depth (0.3 ms) each time. Bytes equal
up to the end of a message mean an equal parse up to there: a JSON parser that has read those bytes stands
in the messages array right after that element whatever follows. So a body that begins with a remembered
body's bytes up to the end of its k-th message reuses that body's first k decoded messages and decodes only
the rest: the new messages, and the other top-level fields (tools etc.: as long whatever the history).

Offsets come from the stdlib's C scanner run over the bytes read as latin-1 (one character a byte, so an
index is a byte offset; every structural character of JSON is ASCII and a byte >= 0x80 only ever sits inside
a string). The values themselves always come from orjson, over exactly the pieces of the body it would read
in one go: the new elements as an array, the members before "messages" and those after it as objects. A
piece orjson refuses, a scan that does not end where the grammar says, a second "messages" member: the
caller decodes the whole body as before, so what is accepted and every error stay as they were.

Reused messages are shared between requests: nothing downstream edits a message in place (the pydantic
models copy each message dict, render.prepare_messages copies before it normalises, and the incremental
renderer already keeps messages from one request to compare with the next).
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass
from typing import Any

try:
    import orjson
except ImportError:  # then there is nothing to reuse: the guard decodes with the stdlib
    orjson = None  # type: ignore[assignment]

MEMO_BODIES = 8  # a few sessions' latest turns; one entry holds a body's bytes (0.6 MB at 128k tokens)
MEMO_BYTES = 64 * 2**20  # and their bytes together, so that 8 bodies at the 32 MiB limit are not all kept
_WS = re.compile(r"[ \t\n\r]*")  # JSON's whitespace, no more (str.isspace takes more)
_scan = json.JSONDecoder().scan_once  # (value, end) of the JSON value at an index; its values are discarded
_SCAN_ERRORS = (StopIteration, ValueError, RecursionError)


@dataclass(frozen=True)
class Seen:
    """A decoded body as the memo keeps it: the body's bytes, the offset of its messages array's '[', the
    offset just past each message, and the decoded messages."""

    raw: bytes
    head: int
    ends: tuple[int, ...]
    messages: tuple[Any, ...]

    def shared(self, raw: bytes) -> int:
        """How many leading messages `raw` shares with this body, byte for byte (head included)."""
        view = memoryview(self.raw)
        if raw.startswith(view[: self.ends[-1]]):  # the common case, a turn that only appended: one memcmp
            return len(self.ends)
        lo, hi = 0, len(self.ends) - 1  # sharing k messages implies sharing all fewer: binary search
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if raw.startswith(view[: self.ends[mid - 1]]):
                lo = mid
            else:
                hi = mid - 1
        return lo


@dataclass(frozen=True)
class Hit:
    """A body decoded with a remembered prefix. `fresh` holds what was decoded now with its nesting depth (the
    body is 1), the rest was checked when first decoded; `seen` is this body's entry, for `BodyMemo.keep`."""

    body: dict[str, Any]
    fresh: list[tuple[Any, int]]
    seen: Seen
    base: Seen


class BodyMemo:
    """The most recent MEMO_BODIES bodies that passed the guard; the guard calls it from worker threads."""

    def __init__(self, size: int = MEMO_BODIES, max_bytes: int = MEMO_BYTES) -> None:
        self.size, self.max_bytes = size, max_bytes
        self.hits = 0  # bodies decoded from a remembered prefix (tests and benchmarks read these)
        self.indexed = 0  # bodies decoded whole and scanned for their message offsets
        self._lock = threading.Lock()
        self._seen: list[Seen] = []  # least recent first

    def lookup(self, raw: bytes) -> Hit | None:
        """`raw` decoded from the remembered body sharing most messages with it, or None (then decode it whole)."""
        if orjson is None:
            return None
        with self._lock:
            entries = list(self._seen)
        best, k = None, 0
        for seen in reversed(entries):
            shared = seen.shared(raw)
            if shared > k:
                best, k = seen, shared
                if shared == len(seen.ends):
                    break
        return _extend(best, k, raw) if best is not None else None

    def index(self, raw: bytes, body: Any) -> Seen | None:
        """The entry of a body decoded whole (`body` is orjson's decode of `raw`), or None when its top level is
        not an object with one "messages" member holding a non-empty array. Scans the whole body once (1.5 ms at
        128k tokens), which only a turn whose history is new pays."""
        if type(body) is not dict or type(body.get("messages")) is not list or not body["messages"]:
            return None
        found = _layout(raw.decode("latin-1"))
        if found is None or len(found[1]) != len(body["messages"]):
            return None
        return Seen(raw, found[0], tuple(found[1]), tuple(body["messages"]))

    def keep(self, seen: Seen, base: Seen | None = None) -> None:
        """Remembers `seen` as the most recent; `base`, the entry it continues, is dropped (`seen` shares at
        least as many messages with any body as `base` does)."""
        with self._lock:
            if base is not None:
                self.hits += 1
            else:
                self.indexed += 1
            self._seen = [s for s in self._seen if s is not base and s.raw != seen.raw]
            self._seen.append(seen)
            del self._seen[: max(0, len(self._seen) - self.size)]
            total = sum(len(s.raw) for s in self._seen)
            while self._seen and total > self.max_bytes:  # least recent first, the newest too if alone too big
                total -= len(self._seen.pop(0).raw)


def _extend(seen: Seen, k: int, raw: bytes) -> Hit | None:
    """`raw`, which shares its first k messages with `seen`, decoded: those k reused, the rest read by orjson."""
    start = seen.ends[k - 1]
    tail = raw[start:].decode("latin-1")
    ends: list[int] = []
    close = _after_element(tail, 0, ends)  # ']' of the messages array, relative to start
    if close is None:
        return None
    at = start + close + 1
    rest = _WS.match(tail, close + 1).end()
    if tail[rest : rest + 1] == ",":
        rest = _WS.match(tail, rest + 1).end()
        if tail[rest : rest + 1] != '"':  # `,}` is no object's end, yet `{` + `}` would read
            return None
    elif tail[rest : rest + 1] != "}":
        return None
    try:
        body = orjson.loads(raw[: seen.head] + b"0}")  # the members before "messages"; it reads 0 there
        new = orjson.loads(b"[" + raw[start + _WS.match(tail).end() + 1 : at]) if ends else []
        after = orjson.loads(b"{" + raw[start + rest :])
    except orjson.JSONDecodeError:
        return None
    if type(body) is not dict or "messages" in after or len(new) != len(ends):
        return None
    body["messages"] = [*seen.messages[:k], *new]
    body.update(after)  # as one decode reads a member named twice: the first's place, the last's value
    fresh = [(v, 2) for key, v in body.items() if key != "messages"] + [(m, 3) for m in new]
    entry = Seen(raw, seen.head, seen.ends[:k] + tuple(start + e for e in ends), (*seen.messages[:k], *new))
    return Hit(body, fresh, entry, seen)


def _after_element(s: str, i: int, ends: list[int]) -> int | None:
    """From just past an array element at s[i]: appends the end of each element that follows and returns the
    index of the array's ']', or None if the text there is no array's continuation."""
    while True:
        i = _WS.match(s, i).end()
        c = s[i : i + 1]
        if c == "]":
            return i
        if c != ",":  # also the digit that would make `12` of the number `1` that ended the prefix
            return None
        try:
            _, i = _scan(s, _WS.match(s, i + 1).end())
        except _SCAN_ERRORS:
            return None
        ends.append(i)


def _layout(s: str) -> tuple[int, list[int]] | None:
    """The offset of the top-level "messages" array's '[' and the end of each of its elements, or None when
    the top level is not an object, holds no such array or holds "messages" twice. A key equals "messages" in
    latin-1 exactly when it does in UTF-8: any byte >= 0x80 would make it a non-ASCII character in both."""
    i = _WS.match(s).end()
    if s[i : i + 1] != "{":
        return None
    head, ends = None, []
    i = _WS.match(s, i + 1).end()
    try:
        while s[i : i + 1] == '"':
            key, i = _scan(s, i)
            i = _WS.match(s, i).end()
            if s[i : i + 1] != ":":
                return None
            i = _WS.match(s, i + 1).end()
            if key == "messages":
                if head is not None or s[i : i + 1] != "[":
                    return None
                head = i
                first = _WS.match(s, i + 1).end()
                _, i = _scan(s, first)
                ends.append(i)
                close = _after_element(s, i, ends)
                if close is None:
                    return None
                i = close + 1
            else:
                _, i = _scan(s, i)
            i = _WS.match(s, i).end()
            if s[i : i + 1] != ",":
                break
            i = _WS.match(s, i + 1).end()
    except _SCAN_ERRORS:
        return None
    return (head, ends) if head is not None and s[i : i + 1] == "}" else None
