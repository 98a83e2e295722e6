"""The synthetic trace: deterministic per seed, calibrated sizes and gaps, and a lossless JSONL round trip."""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

import pytest

from agentbox import trace
from agentbox.bench import synth
from agentbox.bench.synth import SynthConfig


def _dump(sessions: list[trace.Session]) -> str:
    return "\n".join(json.dumps(s.to_json(), sort_keys=True) for s in sessions)


def test_same_seed_same_trace_other_seed_other_trace() -> None:
    cfg = SynthConfig(sessions=4, turns=12, scale=0.2)
    assert _dump(synth.generate(cfg)) == _dump(synth.generate(cfg))
    assert _dump(synth.generate(cfg)) != _dump(
        synth.generate(SynthConfig(sessions=4, turns=12, scale=0.2, seed=1))
    )


def test_session_i_does_not_depend_on_the_number_of_sessions() -> None:
    few = synth.generate(SynthConfig(sessions=2, turns=10, scale=0.2))
    many = synth.generate(SynthConfig(sessions=5, turns=10, scale=0.2))
    assert _dump(few) == _dump(many[:2])


def test_shared_prefix_is_identical_across_sessions_and_sized() -> None:
    sessions = synth.generate(SynthConfig(sessions=3, turns=5))
    first = json.dumps(sessions[0].prefix.messages) + json.dumps(sessions[0].prefix.tools)
    assert all(json.dumps(s.prefix.messages) + json.dumps(s.prefix.tools) == first for s in sessions)
    assert 2500 <= trace.estimate_tokens(first) <= 3600  # "a few thousand tokens" at scale 1
    assert {t["function"]["name"] for t in sessions[0].prefix.tools} >= {"execute_bash", "finish"}


def test_default_shape_matches_published_agent_traffic() -> None:
    sessions = synth.generate(SynthConfig(sessions=40))
    turns = [len(s.turns) for s in sessions]
    assert 45 <= statistics.median(turns) <= 75  # median about 60 turns
    final = [sum(trace.estimate_tokens(json.dumps(m)) for m in list(s.prompts())[-1]) for s in sessions]
    assert 10_000 <= statistics.median(final) <= 60_000  # histories of tens of thousands of tokens
    results = [
        trace.estimate_tokens(m["content"])
        for s in sessions
        for t in s.turns
        for m in t.messages
        if m["role"] == "tool"
    ]
    assert max(results) > 8 * statistics.median(results)  # heavy tail: whole files next to short outputs


def test_turns_are_a_valid_tool_calling_conversation() -> None:
    (s,) = synth.generate(SynthConfig(sessions=1, turns=6, turn_sigma=0.0, scale=0.1, wait=0.5))
    assert len(s.turns) == 6
    assert s.turns[0].messages[0]["role"] == "user"
    for prev, turn in zip(s.turns, s.turns[1:], strict=False):
        (result,) = turn.messages
        assert result["role"] == "tool" and result["tool_call_id"] == prev.tool_calls[0]["id"]
        assert prev.wait_s == 0.5 and prev.output_tokens >= 1 and prev.output
    assert s.turns[-1].wait_s == 0.0 and s.turns[-1].tool_calls[0]["function"]["name"] == "finish"


def test_lognormal_waits_are_calibrated() -> None:
    rng = random.Random(7)
    waits = [synth.sample_wait(rng) for _ in range(20_000)]
    assert 0.36 <= statistics.median(waits) <= 0.48  # median gap about 0.42 s
    assert 0.82 <= sum(w < 1 for w in waits) / len(waits) <= 0.90  # 86 % within 1 s
    assert 0.93 <= sum(w < 10 for w in waits) / len(waits) <= 0.97  # 95 % within 10 s


def test_scale_and_context_cap_shrink_the_trace() -> None:
    full = synth.generate(SynthConfig(sessions=4, turns=20, turn_sigma=0.0))
    small = synth.generate(SynthConfig(sessions=4, turns=20, turn_sigma=0.0, scale=0.1))

    def sizes(ss: list[trace.Session]) -> tuple[int, float]:
        outputs = sum(t.output_tokens for s in ss for t in s.turns)
        results = [trace.estimate_tokens(m["content"]) for s in ss for t in s.turns[1:] for m in t.messages]
        return outputs, statistics.median(results)

    (out_full, res_full), (out_small, res_small) = sizes(full), sizes(small)
    assert out_small < out_full / 5 and res_small < res_full / 4
    capped = synth.generate(SynthConfig(sessions=3, turns=60, scale=0.2, max_context_tokens=2000))
    for s in capped:
        est = trace.estimate_tokens(s.prefix.messages[0]["content"]) + trace.estimate_tokens(
            json.dumps(s.prefix.tools)
        )
        est += sum(trace.estimate_tokens(m["content"]) for t in s.turns for m in t.messages)
        est += sum(t.output_tokens for t in s.turns)
        assert est <= 2000 or len(s.turns) == 1


def test_save_load_round_trip(tmp_path: Path) -> None:
    sessions = synth.generate(SynthConfig(sessions=3, turns=4, scale=0.1))
    path = tmp_path / "t.jsonl"
    trace.save(sessions, path)
    assert len(path.read_text().splitlines()) == 3  # one session a line
    assert _dump(trace.load(path)) == _dump(sessions)


def test_load_reports_the_bad_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": "x", "prefix": {"messages": []}, "turns": []}\n{"id": "y"}\n')
    with pytest.raises(ValueError, match=":2:"):
        trace.load(path)


def test_flatten_tools_keeps_only_plain_roles() -> None:
    (s,) = trace.flatten_tools(synth.generate(SynthConfig(sessions=1, turns=3, turn_sigma=0.0, scale=0.1)))
    assert s.prefix.tools == [] and "execute_bash" in s.prefix.messages[0]["content"]
    for msgs in s.prompts():
        assert {m["role"] for m in msgs} <= {"system", "user", "assistant"}
        assert all(isinstance(m["content"], str) and set(m) == {"role", "content"} for m in msgs)
    assert "<tool_call>" in s.turns[0].output
