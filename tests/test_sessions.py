"""Session leases: TTL learned from each session's own gaps, expiry on a fake clock, counters."""

from __future__ import annotations

import pytest

from agentbox.config import EngineConfig
from agentbox.engine.cache.sessions import (
    LeaseState,
    SessionTable,
    page_hashes,
    quantile,
    sessions_by_lease_age,
)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _turns(table: SessionTable, clock: Clock, sid: str, gaps: list[float], work: float = 1.0) -> None:
    """One turn per gap: the turn takes `work` seconds, then the tool runs for the gap."""
    table.begin_turn(sid)
    for gap in gaps:
        clock.t += work
        table.end_turn(sid)
        clock.t += gap
        table.begin_turn(sid)
    clock.t += work
    table.end_turn(sid)


def test_ttl_is_the_default_before_any_gap() -> None:
    clock = Clock()
    table = SessionTable(default_ttl_s=10.0, max_ttl_s=120.0, clock=clock)
    s = table.begin_turn("s")
    assert s.turns == 1 and not s.gaps
    assert table.ttl(s) == 10.0
    assert table.lease_state("s") is LeaseState.NONE  # no lease until the turn ends
    table.end_turn("s")
    assert s.lease_expiry == pytest.approx(110.0)


def test_ttl_learned_from_own_gaps_and_clamped() -> None:
    clock = Clock()
    table = SessionTable(default_ttl_s=10.0, max_ttl_s=120.0, clock=clock, min_ttl_s=2.0)
    _turns(table, clock, "quick", [0.4] * 10)
    _turns(table, clock, "mid", [4.0, 6.0, 5.0, 8.0, 5.0])
    _turns(table, clock, "slow", [300.0, 200.0])
    quick, mid, slow = table.get("quick"), table.get("mid"), table.get("slow")
    assert quick is not None and mid is not None and slow is not None
    assert list(quick.gaps) == pytest.approx([0.4] * 10)  # measured from turn end to next turn start
    assert table.ttl(quick) == 2.0  # floor
    assert table.ttl(mid) == pytest.approx(quantile([4.0, 6.0, 5.0, 8.0, 5.0], 0.9) * 1.5)
    assert table.ttl(slow) == 120.0  # lease_max_ttl_s
    assert table.expected_gap(mid) == 5.0 and quick.turns == 11


def test_lease_expires_and_a_refresh_extends_it() -> None:
    clock = Clock()
    table = SessionTable(default_ttl_s=10.0, clock=clock)
    _turns(table, clock, "s", [])
    assert table.lease_state("s") is LeaseState.LIVE
    clock.t += 9.0
    table.refresh("s")  # a hit
    clock.t += 9.0
    assert table.lease_state("s") is LeaseState.LIVE
    clock.t += 1.5
    assert table.lease_state("s") is LeaseState.EXPIRED
    assert [x.id for x in table.live()] == []
    table.refresh("s")
    assert table.lease_state("s") is LeaseState.LIVE
    table.release_lease("s")
    assert table.lease_state("s") is LeaseState.NONE
    assert table.lease_state("unknown") is LeaseState.NONE


def test_lease_age_orders_the_cap() -> None:
    clock = Clock()
    table = SessionTable(clock=clock)
    for sid in ("b", "a", "c"):
        table.refresh(sid)
        clock.t += 1.0
    table.refresh("b")  # an extension keeps the original grant time
    assert [s.id for s in sessions_by_lease_age(table)] == ["b", "a", "c"]


def test_gap_not_measured_across_overlapping_requests() -> None:
    clock = Clock()
    table = SessionTable(clock=clock)
    table.begin_turn("s")
    clock.t += 1.0
    table.end_turn("s")
    clock.t += 2.0
    table.begin_turn("s")
    table.begin_turn("s")  # a second request while the first is running: not a new gap
    s = table.get("s")
    assert s is not None and list(s.gaps) == [2.0] and s.turns == 3


def test_counters_and_recomputed_history() -> None:
    table = SessionTable(clock=Clock())
    history = [1, 2, 3, 4, 5, 6, 7]
    table.record_history("s", history, 2)
    # The next prompt repeats 6 page-aligned history tokens; 2 came from cache (GPU), so 4 were recomputed.
    assert table.record_prompt("s", history + [8, 9], cached_tokens=2, host_tokens=0, page_size=2) == 4
    # A prompt that diverges after one page repeats only 2 tokens of history.
    assert table.record_prompt("s", [1, 2, 9, 9, 9, 9], cached_tokens=0, host_tokens=0, page_size=2) == 2
    assert table.record_prompt("s", history, cached_tokens=6, host_tokens=4, page_size=2) == 0
    table.record_ttft("s", 0.25)
    s = table.get("s")
    assert s is not None
    assert (s.prompt_tokens, s.cached_tokens_gpu, s.cached_tokens_host, s.recomputed_tokens) == (22, 4, 4, 6)
    assert s.last_ttft_s == 0.25 and s.lease_state(table.clock()) is LeaseState.NONE


def test_history_is_not_shrunk_by_a_prefix_given_back() -> None:
    # A preempted (or aborted) request gives its computed part back: it re-inserts a prefix of what the
    # session already computed, which must not become its history.
    table = SessionTable(clock=Clock())
    history = [1, 2, 3, 4, 5, 6, 7, 8]
    table.record_history("s", history, 2)
    table.record_history("s", history[:2], 2)
    table.record_history("s", [], 2)
    s = table.get("s")
    assert s is not None and s.last_sequence_tokens == 8
    assert table.record_prompt("s", history + [9, 9], cached_tokens=2, host_tokens=0, page_size=2) == 6
    # A sequence that goes past or away from the history replaces it.
    table.record_history("s", [1, 2, 7, 7], 2)
    assert s.last_sequence_tokens == 4
    assert table.record_prompt("s", history, cached_tokens=0, host_tokens=0, page_size=2) == 2


def test_page_hashes_chain_the_prefix() -> None:
    a, b = page_hashes([1, 2, 3, 4, 5], 2), page_hashes([9, 9, 3, 4], 2)
    assert len(a) == 2 and a[1] != b[1]  # same page, different prefix


def test_from_config() -> None:
    cfg = EngineConfig(lease_default_ttl_s=3.0, lease_max_ttl_s=30.0, lease_max_share=0.5)
    table = SessionTable.from_config(cfg, Clock())
    assert (table.default_ttl_s, table.max_ttl_s, table.max_share) == (3.0, 30.0, 0.5)
    assert len(table) == 0 and "x" not in table
