"""The per-session page-hash memo gives exactly sessions.page_hashes, whatever the session sends next
(a longer transcript, an edited one, a shorter one, another session's), and forgets past its bound; the prefix
compares it rests on agree with plain list compares."""

from __future__ import annotations

from array import array

import hypothesis.strategies as st
from hypothesis import given

from agentbox.engine.cache.page_hash_memo import PageHashMemo
from agentbox.engine.cache.sessions import page_hashes
from agentbox.prefix import NUMPY_FROM, common_prefix, ids_equal, ids_prefix

seqs = st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.sampled_from(["grow", "edit", "cut"]),
                          st.lists(st.integers(0, 3), max_size=20)), max_size=15)


@given(ops=seqs)
def test_memo_equals_page_hashes(ops: list[tuple[str, str, list[int]]]) -> None:
    memo = PageHashMemo(max_sessions=2)  # three sessions over two slots: some are forgotten and rehashed
    tokens: dict[str, list[int]] = {}
    for sid, op, new in ops:
        t = tokens.get(sid, [])
        if op == "grow":
            t = t + new
        elif op == "edit":
            t = t[: len(new)] + new
        else:
            t = t[: len(new)]
        tokens[sid] = t
        # a prompt's int32 array (from the API process) or a list, in any order: the same hashes
        given_as = array("i", t) if (len(t) + len(new)) % 2 else t
        assert memo.hashes(sid, given_as, 4) == page_hashes(t, 4)


@given(a=st.lists(st.integers(0, 2), max_size=600), b=st.lists(st.integers(0, 2), max_size=600))
def test_common_prefix(a: list[int], b: list[int]) -> None:
    n = common_prefix(a, b)
    assert a[:n] == b[:n] and (n == min(len(a), len(b)) or a[n] != b[n])


@given(a=st.lists(st.integers(0, 2), max_size=600), b=st.lists(st.integers(0, 2), max_size=600),
       at=st.integers(0, 650), shared=st.sampled_from([0, NUMPY_FROM + 5]))
def test_int32_array_compares_equal_the_lists(a: list[int], b: list[int], at: int, shared: int) -> None:
    """The compares of int32 arrays (prompts from the API process; numpy from NUMPY_FROM ids) agree with plain
    list compares."""
    base = [7] * shared  # a common start long enough for the numpy paths
    a, b, at = base + a, base + b, at + (shared if at % 2 else 0)
    want = common_prefix(a, b)
    assert common_prefix(array("i", a), array("i", b)) == want
    tail = b[at:]
    n = ids_prefix(array("i", a), array("i", b), at)
    assert a[:n] == tail[:n] and (n == min(len(a), len(tail)) or a[n] != tail[n])
    assert ids_equal(array("i", b), at, array("i", a)) == (at + len(a) <= len(b) and b[at : at + len(a)] == a)
    assert ids_equal(array("i", b), at, array("i", tail[: len(a)])) == (at <= len(b))  # b holds its own slice
