"""The loop guard on token streams (pure), and the parallel-call filter of the chat pipeline."""

from __future__ import annotations

import random

from agentbox.chat.tool_parsers import Delta, ToolCallDelta
from agentbox.engine.loop_guard import LoopGuard
from agentbox.server.chat_pipeline import DistinctCalls


def _trips_at(tokens: list[int], guard: LoopGuard) -> int | None:
    for i, t in enumerate(tokens):
        if guard.feed(t):
            return i
    return None


def test_cycles_up_to_the_max_period_trip_and_name_their_period() -> None:
    for period in (1, 2, 7, 48):
        cycle = list(range(100, 100 + period))
        prefix = [random.Random(period).randrange(50) for _ in range(30)]
        guard = LoopGuard(48, 8, 128)
        at = _trips_at(prefix + cycle * 200, guard)
        assert at is not None and guard.period == period
        repeated = at - len(prefix) + 1
        assert repeated >= max(128, 7 * period) and repeated <= max(128, 7 * period) + period


def test_varied_text_and_long_periods_do_not_trip() -> None:
    rng = random.Random(0)
    assert _trips_at([rng.randrange(1000) for _ in range(20000)], LoopGuard(48, 8, 128)) is None
    assert _trips_at(list(range(60)) * 50, LoopGuard(48, 8, 128)) is None  # a 60-token cycle is past the max
    assert _trips_at([5] * 100 + [6], LoopGuard(48, 8, 128)) is None  # 100 repeats < min_tokens


def _call(index: int, name: str, args: str) -> list[Delta]:
    return [Delta(tool_call=ToolCallDelta(index, id=f"c{index}", name=name)),
            Delta(tool_call=ToolCallDelta(index, arguments=args[:3])), Delta(tool_call=ToolCallDelta(index, arguments=args[3:]))]


def test_a_repeated_parallel_call_is_dropped_and_indices_stay_dense() -> None:
    d = DistinctCalls()
    out = d.feed(_call(0, "ls", '{"p": 1}') + _call(1, "ls", '{"p":1}') + _call(2, "cat", '{"p": 1}'))
    out += d.feed([Delta(content="x")]) + d.finish()
    calls = [x.tool_call for x in out if x.tool_call is not None]
    assert [(c.index, c.name) for c in calls if c.name] == [(0, "ls"), (1, "cat")]
    assert "".join(c.arguments for c in calls if c.index == 1) == '{"p": 1}'
