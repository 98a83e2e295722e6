"""A session's prompt crosses the pipe as the ids the engine lacks: the engine keeps each session's last prompt.

A warm agent turn re-sends its whole history: at 128k tokens, pickling 121k ids in the API process and
unpickling them in the engine cost 10-25 ms a turn on this 2-core EPYC, for the ~20 ids the turn added. Both
ends keep, per session key, the last prompt sent under it and its version (a counter the API process assigns).
A request then carries only its ids past the prefix it shares with that prompt, the version it builds on, and
a check: the hash of the ids just before the cut. The engine rebuilds the prompt from its own copy; when it
has no copy of that version or the check differs (it restarted, or dropped the key), it answers `resend` and
the API process sends the full ids. Both ends keep the same bounded number of keys, most recent first.

The API side holds ids as int32 arrays (what the incremental tokenizer returns): the common prefix of two
121k-id arrays takes ~0.02 ms (numpy, agentbox/prefix.py), of two lists ~1.6 ms. The engine side keeps both: the list the request
takes, and the array, which the request hands the cache for its compares (engine/request.py `prompt_ids`).
Building them from the last ones copies the history: 0.45 ms a 128k turn on this Xeon (a list slice; an array's
`tolist` costs 4.5 ms). So the engine makes those copies while it is idle (`prepare_spare`: its requests are
done then, their lists no longer grow), and a turn truncates the spare copies to the shared part and appends
its delta: its cost is its new ids and the tail it cuts, not its history.
"""

from __future__ import annotations

import itertools
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from agentbox import collector
from agentbox.prefix import common_prefix

MAX_KEYS = 16  # sessions whose last prompt each side keeps (~4 MB of ids each at 128k tokens, +1.5 MB of idle copies)
MIN_SHARED = 256  # a shorter shared prefix is not worth the bookkeeping: the full ids go
CHECK_IDS = 64  # ids before the cut that the check hashes
RESEND = "resend_prompt"  # the engine's error code: the base is unknown, send the full ids


def boundary_check(ids: Sequence[int], n: int) -> int:
    """The check of a cut after n ids (a hash of ints is the same in every process: no hash seed)."""
    return hash(tuple(ids[max(0, n - CHECK_IDS) : n]))


class PromptSender:
    """The API process's side: what to send for a session's next prompt."""

    def __init__(self, max_keys: int = MAX_KEYS) -> None:
        self.max_keys = max_keys
        self._last: OrderedDict[str, tuple[int, array]] = OrderedDict()
        self._versions = itertools.count(1)

    def encode(self, key: str | None, ids: Sequence[int]) -> tuple[Sequence[int], int, int, int, int]:
        """(ids to send, version of this prompt, base version, shared ids, check); shared 0: the full ids.
        Call in send order: the engine must see the versions in the order they were assigned."""
        if key is None:
            return ids, 0, 0, 0, 0
        if not isinstance(ids, array) or ids.typecode != "i":
            ids = array("i", ids)  # a prompt not from the chat tokenizer (/v1/completions' own ids)
        version = next(self._versions)
        last = self._last.pop(key, None)
        self._last[key] = (version, ids)
        while len(self._last) > self.max_keys:
            self._last.popitem(last=False)
        shared = common_prefix(last[1], ids) if last is not None else 0
        if shared < MIN_SHARED:
            return ids, version, 0, 0, 0
        assert last is not None
        return ids[shared:], version, last[0], shared, boundary_check(ids, shared)

    def forget(self, key: str | None) -> None:
        """After a resend: the next prompt under key goes whole (the engine's copy is not to be trusted)."""
        if key is not None:
            self._last.pop(key, None)

    def clear(self) -> None:
        """A new engine process knows no prompt."""
        self._last.clear()


@dataclass(frozen=True)
class Rebuilt:
    """A prompt as the engine rebuilt it. `ids` is a list the request takes as its own: the store reads only its
    first len(prompt) ids again (or copies it whole while no request runs), which a request never changes (its
    list only grows). `array` is the same ids as an int32 array when they came as one (never mutated; None for
    a list sent whole)."""

    ids: list[int]
    array: array | None


@dataclass
class _Entry:
    """A key's last prompt, and private copies of its ids made at an idle moment (nothing else holds them: a
    rebuild may cut and extend them in place)."""

    version: int
    prompt: Rebuilt
    spare_ids: list[int] | None = None
    spare_array: array | None = None


class PromptStore:
    """The engine's side: each key's last prompt, to rebuild a delta from."""

    def __init__(self, max_keys: int = MAX_KEYS) -> None:
        self.max_keys = max_keys
        self._last: OrderedDict[str, _Entry] = OrderedDict()

    def rebuild(self, key: str | None, version: int, ids: Sequence[int], base_version: int, shared: int,
                check: int) -> Rebuilt | None:
        """The full prompt (kept under key when given), or None when the base is not the one the sender meant."""
        if shared:
            last = self._last.get(key) if key is not None else None
            if last is None or last.version != base_version or len(last.prompt.ids) < shared:
                return None
            if boundary_check(last.prompt.ids, shared) != check:
                return None
            delta = ids if isinstance(ids, array) else array("i", ids)
            if last.spare_ids is not None:  # this key's idle copies: cut to the shared part, the delta appended
                prompt, arr = last.spare_ids, last.spare_array
                last.spare_ids = last.spare_array = None
                del prompt[shared:]
                if arr is not None:
                    del arr[shared:]
                    arr.extend(delta)
            else:  # one copy of the history (its ints shared), then the delta appended
                prompt = last.prompt.ids[:shared]
                arr = None if last.prompt.array is None else last.prompt.array[:shared] + delta
            prompt.extend(ids)
        elif isinstance(ids, array):  # the full ids: the API process's array, or a list
            prompt, arr = ids.tolist(), ids
        else:
            prompt, arr = list(ids), None
        out = Rebuilt(prompt, arr)
        if key is not None and version:
            replaced = self._last.pop(key, None)
            if replaced is not None:  # often the last holder of a 121k-id list: freeing it took 0.2-0.3 ms of the turn
                collector.free_when_idle(replaced)
            self._last[key] = _Entry(version, out)
            while len(self._last) > self.max_keys:
                collector.free_when_idle(self._last.popitem(last=False))
        return out

    def prepare_spare(self) -> bool:
        """Copy the most recent key's prompt that has no spare copies yet; False when none lacks them. Call only
        while no request runs: a running request's list still grows, and the copy must be of what it will be
        when the next delta comes (its prompt's ids, then its output's, which the next turn cuts off)."""
        for entry in reversed(self._last.values()):
            if entry.spare_ids is None:
                entry.spare_ids = entry.prompt.ids[:]
                entry.spare_array = None if entry.prompt.array is None else entry.prompt.array[:]
                return True
        return False
