"""The length of the common prefix of two sequences (texts, token or hash tuples), at C speed.

A warm turn re-sends its whole history; comparing it element by element in Python costs O(history) a turn.
Slice compares over blocks that double, then a binary search inside the first differing block, cost
O(the common prefix) in C: the API's incremental tokenizer (chat/incremental.py) and the cache's page-hash
memo (engine/cache/page_hash_memo.py) both use it. A leaf module: it imports nothing of agentbox.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence


def common_prefix(a: Sequence, b: Sequence) -> int:  # type: ignore[type-arg]  # str or tuple alike
    """Length of the longest common prefix of a and b: two strs, tuples, lists or int32 arrays. A tuple against
    an array (a memo's kept sequence against a prompt from the API process) compares a as b's type, one copy."""
    if type(a) is not type(b) and isinstance(b, tuple | array):
        a = tuple(a) if isinstance(b, tuple) else array("i", a)
    n = min(len(a), len(b))
    lo, step, hi = 0, 64, 0  # a[:lo] == b[:lo]
    while lo < n:
        hi = min(n, lo + step)
        if a[lo:hi] != b[lo:hi]:
            break
        lo, step = hi, step * 2
    else:
        return n
    while hi - lo > 1:  # a[:lo] == b[:lo], a[:hi] != b[:hi]
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo
