"""An engine crash loses no finished turn (issue 51's proof): a real server (SmolLM2, the official client) with a
disk tier and a pool that keeps every session in memory; 8 sessions x 3 completed turns; `kill -9` of the engine
process alone (the API process restarts it). Each session's next turn is then >= 90 % cached, read back from
what the write-behind put on disk at each turn's end, and its greedy answer equals a cold server's on the same
prompt (the shared live server: it has never seen these prompts). The restart's log line counts what came back.

Before write-behind, a session still in GPU memory at the kill came back with 0 of its tokens cached."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from agentbox.bench.spawn import agentbox_command, spawned

pytestmark = pytest.mark.slow
SESSIONS, TURNS = 8, 3
SYSTEM = ("You are a careful coding assistant working in a large C++ repository. Before you change a file you read "
          "it, you explain what you are about to do in one sentence, and you keep every answer short. The build uses "
          "CMake and Ninja, the tests use GoogleTest, and the style guide asks for four-space indentation, no "
          "exceptions in library code and explicit error codes. ") * 3
SERVE = ["--num-pages", "512", "--max-num-seqs", "8", "--max-model-len", "2048", "--exact-cpu",
         "--disk-cache-gb", "1", "--speculative", "off"]


def _user(s: int, t: int) -> str:
    return (f"Session {s}, step {t}: the test widget_{s}_{t} fails with a segmentation fault in "
            f"parse_config_{s * 7 + t}; the stack shows frobnicate_{t} calling into libwidget. What next?")


def _turn(client: OpenAI, messages: list[dict[str, str]], session: str) -> tuple[str, int, int]:
    """(greedy answer, prompt tokens, cached tokens)."""
    r = client.chat.completions.create(model="default", messages=messages, max_tokens=12, temperature=0,  # type: ignore[arg-type]
                                       extra_headers={"X-Session-Id": session})
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    return r.choices[0].message.content or "", r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens or 0


def _stats(url: str) -> dict:
    return httpx.get(url + "/v1/stats", timeout=60).json()


def test_kill_9_of_the_engine_loses_no_finished_turn(live_server: str, smollm2_path: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    with spawned(agentbox_command(str(smollm2_path), SERVE), tmp_path / "server.log", home=str(home)) as (url, _):
        client = OpenAI(base_url=url + "/v1", api_key="none", timeout=300)
        chats = {s: [{"role": "system", "content": SYSTEM}] for s in range(SESSIONS)}

        def turn(s: int, t: int) -> None:
            chats[s].append({"role": "user", "content": _user(s, t)})
            answer, _, _ = _turn(client, chats[s], f"agent-{s}")
            chats[s].append({"role": "assistant", "content": answer})

        with ThreadPoolExecutor(SESSIONS) as pool:
            for t in range(TURNS):  # the sessions' turns run side by side, as agents' do
                list(pool.map(turn, range(SESSIONS), [t] * SESSIONS))
        nexts = {s: [*chats[s], {"role": "user", "content": "Go on."}] for s in range(SESSIONS)}
        deadline = time.monotonic() + 120
        while (before := _stats(url))["cache"]["disk_queued"] or before["running"]:  # the last turns' writes land
            assert time.monotonic() < deadline, before["cache"]
            time.sleep(0.2)
        cache = before["cache"]
        assert cache["evictions"] == 0 and cache["disk_written_behind"] > 0 and cache["disk_dropped"] == 0
        os.kill(before["engine_pid"], signal.SIGKILL)  # the engine alone: the API process restarts it
        deadline = time.monotonic() + 300
        while True:  # /health and /v1/stats answer 503 while the engine restarts
            r = httpx.get(url + "/v1/stats", timeout=60)
            if r.status_code == 200 and r.json()["engine_pid"] != before["engine_pid"]:
                break
            assert time.monotonic() < deadline, r.text
            time.sleep(0.5)
        reference = OpenAI(base_url=live_server + "/v1", api_key="none", timeout=300)
        for s in range(SESSIONS):
            answer, prompt, cached = _turn(client, nexts[s], f"agent-{s}")
            cold, _, cold_cached = _turn(reference, nexts[s], f"reference-{s}")
            print(f"session {s}: {cached}/{prompt} cached after the kill; answer {answer!r}")
            assert cached >= 0.9 * prompt, (s, cached, prompt)
            assert cold_cached < 0.9 * prompt  # the reference computed it: it is a fresh server's answer
            assert answer == cold, (s, answer, cold)
        assert _stats(url)["cache"]["disk_restored"] > 0  # the cached tokens were read back from disk
    log = (tmp_path / "server.log").read_text()
    line = next(x for x in log.splitlines() if "engine restarted after" in x)
    assert "KV pages" in line and "came back" in line and "every session's cache was lost" not in line, line
    print(line)
