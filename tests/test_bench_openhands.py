"""The OpenHands trajectory converter on a small hand-written fixture."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentbox import trace
from agentbox.bench import openhands

FIXTURE = Path(__file__).parent / "fixtures" / "openhands_small.json"


def test_fixture_converts_into_turns_ending_at_each_assistant_message() -> None:
    astropy, django = openhands.convert_file(FIXTURE, wait_s=5.0)
    assert astropy.id == "astropy__astropy-12907" and django.id == "django__django-11099"
    # system message + tools are the shared prefix; typed content parts became one string
    assert astropy.prefix.messages == [
        {
            "role": "system",
            "content": "You are OpenHands agent, a helpful AI assistant that can interact with a "
            "computer to solve tasks.",
        }
    ]
    assert [t["function"]["name"] for t in astropy.prefix.tools] == [
        "execute_bash",
        "str_replace_editor",
        "finish",
    ]
    assert astropy.prefix.messages == django.prefix.messages  # same agent, same prefix
    # four assistant messages → four turns; the trailing tool result after `finish` answers nothing
    assert len(astropy.turns) == 4 and len(django.turns) == 2
    first, second = astropy.turns[:2]
    assert first.messages[0]["role"] == "user" and "separability_matrix" in first.messages[0]["content"]
    assert first.output == "Let me look at the repository structure first."
    assert first.tool_calls[0]["function"]["name"] == "execute_bash"
    assert second.messages == [
        {
            "role": "tool",
            "tool_call_id": "toolu_1",
            "name": "execute_bash",
            "content": "__init__.py\ncore.py\nfitting.py\nseparable.py\ntests\n[The command completed with exit code 0.]",
        }
    ]
    assert second.output == "" and second.tool_calls[0]["id"] == "toolu_2"
    assert [t.wait_s for t in astropy.turns] == [5.0, 5.0, 5.0, 0.0]
    assert all(t.output_tokens >= trace.estimate_tokens(json.dumps(t.tool_calls)) for t in astropy.turns)


def test_replayed_prompts_rebuild_the_recorded_conversation() -> None:
    raw = json.loads(FIXTURE.read_text())[1]["messages"]
    (_, django) = openhands.convert_file(FIXTURE)
    *_, last_prompt = django.prompts()
    assert [m["role"] for m in last_prompt] == [m["role"] for m in raw[:-1]]
    assert [m["content"] for m in last_prompt] == [m["content"] for m in raw[:-1]]


def test_other_layouts_a_bare_message_list_and_jsonl(tmp_path: Path) -> None:
    raw = json.loads(FIXTURE.read_text())
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(raw[1]["messages"]))
    (s,) = openhands.convert_file(bare)
    assert s.id == "bare-0" and len(s.turns) == 2 and s.prefix.tools == []
    lines = tmp_path / "many.jsonl"
    lines.write_text("\n".join(json.dumps(t) for t in raw) + "\n")
    assert [s.id for s in openhands.convert_file(lines)] == ["astropy__astropy-12907", "django__django-11099"]


def test_a_trajectory_without_answers_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "empty.json"
    path.write_text(json.dumps({"id": "x", "messages": [{"role": "user", "content": "hi"}]}))
    with pytest.raises(ValueError, match="no assistant turn"):
        openhands.convert_file(path)
