"""Recording live requests as a trace, and that the recorded trace replays the client's exact prompts."""

from __future__ import annotations

from pathlib import Path

from agentbox import trace
from agentbox.server.trace_recorder import TraceRecorder

TOOLS = [{"type": "function", "function": {"name": "sh", "parameters": {"type": "object", "properties": {}}}}]
SYSTEM = {"role": "system", "content": "be brief"}
CALL = [{"id": "c1", "type": "function", "function": {"name": "sh", "arguments": "{}"}}]


def test_recorded_sessions_replay_the_client_prompts(tmp_path: Path) -> None:
    rec = TraceRecorder(tmp_path / "live.jsonl")
    p1 = [SYSTEM, {"role": "user", "content": "fix it"}]
    rec.record("k", p1, TOOLS, "model text", None, 5, started=10.0, finished=11.0)
    # the client echoes its own version of the answer (with the tool call it parsed), then the result
    echoed = {"role": "assistant", "content": "client text", "tool_calls": CALL}
    p2 = [*p1, echoed, {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    rec.record("k", p2, TOOLS, "done", None, 3, started=11.4, finished=12.0)
    rec.record(
        "other", [{"role": "user", "content": "hi"}], None, "hello", None, 2, started=10.5, finished=10.7
    )
    # a request that does not extend the previous one: a new session under the same key
    rec.record("k", [SYSTEM, {"role": "user", "content": "new task"}], TOOLS, "x", None, 1, 20.0, 21.0)
    rec.save()

    k, other, k2 = trace.load(tmp_path / "live.jsonl")
    assert [k.id, other.id, k2.id] == ["k", "other", "k#2"]
    assert k.prefix.messages == [SYSTEM] and k.prefix.tools == TOOLS and other.prefix.messages == []
    assert list(k.prompts()) == [p1, p2]  # byte for byte what the client sent
    first, second = k.turns
    assert (first.output, first.tool_calls, first.output_tokens) == ("client text", CALL, 5)
    assert first.wait_s == 0.4 and second.wait_s == 0.0 and second.output == "done"
    assert k2.turns[0].messages == [{"role": "user", "content": "new task"}]
    assert not (tmp_path / "live.jsonl.tmp").exists()
