"""Replay statistics on a hand-made set of per-turn records, every number worked out by hand."""

from __future__ import annotations

import pytest

from agentbox.bench.stats import TurnRecord, history_accounting, percentile, summarize, ttft_by_turn


def rec(
    session: str,
    turn: int,
    ttft: float | None,
    prompt: int,
    cached: int | None,
    out: int,
    error: str | None = None,
) -> TurnRecord:
    return TurnRecord(session, turn, 0.0, ttft, (ttft or 0) + 1.0, prompt, cached, out, error)


# History at turn k is turn k-1's prompt. Session a: a perfect cache (every turn's history was cached).
# Session b: turn 1 lost 100 of its 250-token history, turn 2 lost all of it. Session c: its turn 1 failed, so c1 and c2 carry no history.
RECORDS = [
    rec("a", 0, 1.0, 200, 0, 20),
    rec("a", 1, 0.2, 260, 220, 20),  # history 200, all cached → 0 recomputed
    rec("a", 2, 0.3, 330, 280, 20),  # history 260, all cached → 0
    rec("b", 0, 2.0, 250, 100, 50),  # turn 0: shared prefix hit, no history yet
    rec("b", 1, 1.5, 400, 150, 50),  # history 250, cached 150 → 100 recomputed
    rec("b", 2, 4.0, 500, None, 50),  # history 400, nothing reported → 400 recomputed
    rec("c", 0, 3.0, 100, 0, 10),
    rec("c", 1, None, 0, None, 0, error="HTTP 500"),
    rec("c", 2, 0.5, 180, 100, 10),  # previous turn failed: not counted
]


def test_history_and_recomputed_history() -> None:
    assert history_accounting(RECORDS) == (200 + 260 + 250 + 400, 0 + 0 + 100 + 400)


def test_summary_numbers() -> None:
    s = summarize("x", RECORDS, wall_s=10.0, cache_policy="lru")
    assert (s.sessions, s.turns, s.errors) == (3, 9, 1)
    assert s.prompt_tokens == 200 + 260 + 330 + 250 + 400 + 500 + 100 + 180
    assert s.cached_tokens == 0 + 220 + 280 + 100 + 150 + 0 + 100
    assert s.cache_reported
    assert s.output_tokens == 60 + 150 + 20
    assert s.history_tokens == 1110 and s.recomputed_tokens == 500
    assert s.recomputed_share == pytest.approx(500 / 1110)
    assert s.output_tok_per_s == pytest.approx(23.0) and s.prompt_tok_per_s == pytest.approx(222.0)
    # TTFTs of the 8 good turns, sorted: 0.2 0.3 0.5 1.0 1.5 2.0 3.0 4.0
    assert s.ttft_p50_s == pytest.approx((1.0 + 1.5) / 2)
    assert s.ttft_p90_s == pytest.approx(3.0 + 0.3 * (4.0 - 3.0))  # rank 6.3
    assert s.ttft_p99_s == pytest.approx(3.0 + 0.93 * (4.0 - 3.0))  # rank 6.93
    assert s.ttft_by_turn_s == [pytest.approx(2.0), pytest.approx(0.85), pytest.approx(0.5)]
    # latencies (ttft + 1) of the good turns after each session's first: 1.2 1.3 2.5 5.0 1.5 -> median 1.5
    assert s.later_latency_p50_s == pytest.approx(1.5)
    assert s.extra == {"cache_policy": "lru"}
    assert s.to_json()["recomputed_share"] == pytest.approx(500 / 1110)


def test_a_server_that_never_reports_cache_recomputes_all_history() -> None:
    records = [rec("s", 0, 1.0, 100, None, 10), rec("s", 1, 1.0, 150, None, 10)]
    s = summarize("llama", records, wall_s=2.0)
    assert not s.cache_reported and s.recomputed_share == 1.0 and s.cached_tokens == 0


def test_percentile_edges() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 0) == 1.0 and percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_empty_run() -> None:
    s = summarize("none", [], wall_s=0.0)
    assert s.turns == 0 and s.recomputed_share is None and s.ttft_p50_s is None and s.ttft_by_turn_s == []
    assert ttft_by_turn([rec("a", 1, None, 0, None, 0, error="x")]) == [None, None]


def test_turns_without_usage_keep_their_timings_but_no_history() -> None:
    records = [
        TurnRecord("s", 0, 0.0, 0.5, 1.0, 0, None, 7, usage=False),
        TurnRecord("s", 1, 2.0, 0.7, 1.0, 0, None, 7, usage=False),
    ]
    s = summarize("no-usage", records, wall_s=2.0)
    assert s.errors == 0 and s.turns_without_usage == 2 and s.ttft_p50_s == pytest.approx(0.6)
    assert s.history_tokens == 0 and s.recomputed_share is None


def test_compare_spec_adds_a_speculation_off_twin_of_each_spawned_agentbox() -> None:
    from agentbox.bench.spawn import Target, agentbox_target, with_speculation_off

    spawned = agentbox_target("m.gguf", "session", ["--num-pages", "9"])
    out = with_speculation_off([spawned, Target(name="server", url="http://127.0.0.1:9")])
    assert [t.name for t in out] == ["agentbox-session", "agentbox-session-spec-off", "server"]
    assert out[1].command == [*(spawned.command or []), "--speculative", "off"]
    assert out[1].meta == {"cache_policy": "session", "speculative": "off"}
