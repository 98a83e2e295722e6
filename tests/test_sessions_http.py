"""The session cache over HTTP, against the live server: a second turn is served from the cache, keyless
conversations are told apart by their cached prefix, and a session can be dropped."""

from __future__ import annotations

import httpx
import openai
import pytest

MODEL = "SmolLM2-135M-Instruct.Q4_1"
PS = 16
pytestmark = pytest.mark.slow


def chat(url: str, messages: list[dict], headers: dict | None = None, max_tokens: int = 8) -> tuple[str, dict]:
    c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120, default_headers=headers or {})
    r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0)
    return r.choices[0].message.content or "", r.usage.model_dump()


def test_second_turn_is_cached_and_session_can_be_dropped(live_server: str) -> None:
    h = {"X-Session-Id": "http-turns"}
    msgs = [{"role": "user", "content": "List the steps to fix a failing unit test in a Python project, briefly."}]
    text, u1 = chat(live_server, msgs, h)
    msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": "Now do step one."}]
    _, u2 = chat(live_server, msgs, h)
    first_turn = u1["prompt_tokens"] + u1["completion_tokens"]
    assert u2["prompt_tokens_details"]["cached_tokens"] >= first_turn // PS * PS > 0
    s = httpx.get(f"{live_server}/v1/sessions/http-turns").json()
    assert s["turns"] == 2 and s["resident_tokens_gpu"] > 0 and len(s["turn_history"]) == 2
    assert s["turn_history"][1]["cached_tokens"] == u2["prompt_tokens_details"]["cached_tokens"]
    assert s["lease_state"] == "live" and s["lease_expires_in_s"] > 0
    metrics = httpx.get(f"{live_server}/metrics").text
    assert "agentbox_cache_hit_rate" in metrics and "agentbox_pool_pages" in metrics
    d = httpx.delete(f"{live_server}/v1/sessions/http-turns").json()
    assert d["deleted"] and d["freed_pages"] > 0
    assert httpx.get(f"{live_server}/v1/sessions/http-turns").status_code == 404


def test_keyless_conversations_are_grouped_by_prefix(live_server: str) -> None:
    topics = {
        "a": "Explain how a hash map handles collisions, with an example in Python code please.",
        # Lengths far apart, so each conversation's prompt-token total identifies its session below.
        "b": "Describe the steps of a TCP three-way handshake and why each step is needed. " * 3,
        "c": "Write a short plan for migrating a small web service from Flask to FastAPI. " * 6,
    }
    convs = {k: [{"role": "user", "content": v}] for k, v in topics.items()}
    prompts: dict[str, list[int]] = {k: [] for k in topics}
    for turn in range(2):
        for k in topics:  # interleaved: a1 b1 c1 a2 b2 c2
            text, u = chat(live_server, convs[k])
            prompts[k].append(u["prompt_tokens"])
            if turn == 1:
                assert u["prompt_tokens_details"]["cached_tokens"] > 0
            convs[k] += [{"role": "assistant", "content": text}, {"role": "user", "content": "Go on."}]
    sessions = httpx.get(f"{live_server}/v1/sessions").json()["data"]
    for k in topics:
        mine = [s for s in sessions if s["prompt_tokens"] == sum(prompts[k]) and s["turns"] == 2]
        assert len(mine) == 1, f"conversation {k}: {sessions}"
        assert mine[0]["id"].startswith("auto-")


def test_record_trace_captures_live_traffic_as_a_replayable_trace(live_server: str, agentbox_home) -> None:  # noqa: ANN001
    from agentbox.trace import load

    h = {"X-Session-Id": "recorded-1"}
    msgs = [{"role": "user", "content": "Open README.md and summarise it."}]
    text, _ = chat(live_server, msgs, h)
    msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": "Now list the tests."}]
    chat(live_server, msgs, h)
    sessions = {s.id: s for s in load(agentbox_home / "recorded.jsonl")}
    rec = sessions["recorded-1"]
    assert len(rec.turns) == 2
    assert rec.turns[0].output == text  # the assistant message as the client sent it back
    assert rec.turns[1].messages == [{"role": "user", "content": "Now list the tests."}]
