"""The radix lookup resumes from the session's deepest node (a hint): its result equals the full walk from the
root, whatever happened to the tree in between (splits, demotions, evictions, other sessions, edited
prefixes), and the lookup stays pure. Prompts come as lists or as the int32 arrays the API process sends (the
cache then compares arrays): the same tree, the same answers."""

from __future__ import annotations

from array import array

import hypothesis.strategies as st
from hypothesis import given, settings
from radix_harness import make_cache, run_turn, snapshot

from agentbox.engine.cache.radix_cache import RadixCache


def full_walk(cache: RadixCache, tokens: list[int]) -> tuple[tuple, int, int]:
    """The keyless lookup never takes a hint: it walks from the root."""
    m = cache.match(tokens, None)
    return m.path, m.num_tokens, m.num_copied_tokens


ops = st.lists(st.tuples(st.sampled_from(["turn", "edit", "other", "demote", "evict", "drop"]),
                         st.lists(st.integers(1, 3), min_size=1, max_size=7)), min_size=1, max_size=12)


@settings(max_examples=150, deadline=None)
@given(ops=ops)
def test_hinted_lookup_equals_the_full_walk(ops: list[tuple[str, list[int]]]) -> None:
    cache, clock = make_cache(num_pages=40, page_size=2, host_pages=20)
    seqs: dict[str, list[int]] = {"a": [5, 5], "b": [5, 5]}
    for k, (op, new) in enumerate(ops):
        clock.t = float(k)
        sid = "b" if op == "other" else "a"
        if op in ("turn", "other"):
            seqs[sid] = seqs[sid] + new  # an agent's next turn: the transcript grows
        elif op == "edit":
            cut = len(new) % max(1, len(seqs["a"]))
            seqs["a"] = seqs["a"][:cut] + new  # an edited history: the hint no longer lies on the path
        elif op == "demote":
            cache.demote(len(new))
        elif op == "evict":
            cache.evict(len(new))
        elif op == "drop":
            cache.drop_session("b")
        for s, tokens in seqs.items():
            for probe in (tokens, tokens + new, tokens[: len(tokens) // 2]):
                before = snapshot(cache)
                walk = full_walk(cache, probe)
                for given_as in (probe, array("i", probe)):
                    m = cache.match(given_as, s)
                    assert (m.path, m.num_tokens, m.num_copied_tokens) == walk
                    assert snapshot(cache) == before
        if op in ("turn", "other", "edit") and cache.reclaimable(cache.match(seqs[sid], sid)) >= 8:
            run_turn(cache, array("i", seqs[sid]) if k % 2 else seqs[sid], sid)  # type: ignore[arg-type]
        cache.check_integrity()


def test_next_turn_resumes_at_the_session_node() -> None:
    """A 3-turn session: the hinted lookup reaches the same deepest node the tree walk does."""
    cache, clock = make_cache(num_pages=40, page_size=2)
    tokens = [1, 1, 2, 2]
    for turn in range(3):
        clock.t = float(turn)
        run_turn(cache, tokens, "s")
        tokens = tokens + [turn + 3] * 4
    m = cache.match(tokens, "s")
    assert m.num_tokens == 12 and m.path[-1].start + len(m.path[-1].key) == 12
    assert (m.path, m.num_tokens, m.num_copied_tokens) == full_walk(cache, tokens)
