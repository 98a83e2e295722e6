"""Sessions survive a restart (issue 26's proof, over HTTP with the real model and the official client): a
conversation of >= 3k tokens, a graceful `agentbox stop`, a new server over the same state directory: the
next turn is >= 90 % cached (read back from disk), its greedy answer equals a cold server's on the same
prompt, and the session is back under its id. The time to first token of both is printed, not asserted."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from rich.console import Console

from agentbox.config import CPU_PAGE_SIZE
from agentbox.tui import panels, session_table
from tests.conftest import _free_port

pytestmark = pytest.mark.slow

FILLER = ("The build failed in module {i}: the linker could not find symbol frobnicate_{i} in libwidget. "
          "I checked the makefile, the include paths and the version of the toolchain, and all of them look "
          "right to me, so the problem must be somewhere in how the object files are ordered. ")


def _agentbox(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agentbox.cli.main", *args], env=env, capture_output=True,
                          text=True, timeout=600)


def _serve(env: dict[str, str], model: Path, port: int) -> None:
    r = _agentbox(env, "serve", "--model", str(model), "--port", str(port), "--num-pages", str(6400 // CPU_PAGE_SIZE),
                  "--max-model-len", "8192", "--max-num-batched-tokens", "2048", "--disk-cache-gb", "2")
    assert r.returncode == 0, r.stderr + Path(env["AGENTBOX_HOME"], "server.log").read_text()


def _turn(client: OpenAI, messages: list[dict[str, str]], session: str) -> tuple[str, float, int, int]:
    """(greedy answer, seconds to its first token, prompt tokens, cached tokens)."""
    t0 = time.perf_counter()
    ttft = None
    text = ""
    usage = None
    stream = client.chat.completions.create(
        model="default", messages=messages, max_tokens=12, temperature=0, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True}, extra_headers={"X-Session-Id": session})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            ttft = ttft if ttft is not None else time.perf_counter() - t0
            text += chunk.choices[0].delta.content
        usage = chunk.usage or usage
    assert usage is not None and usage.prompt_tokens_details is not None and ttft is not None
    return text, ttft, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens or 0


def test_a_session_survives_a_graceful_restart(smollm2_path: Path, tmp_path: Path) -> None:
    env = {**os.environ, "AGENTBOX_HOME": str(tmp_path)}
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    history = [{"role": "system", "content": "You are a helpful coding assistant."}]
    for i in range(9):
        history += [{"role": "user", "content": " ".join(FILLER.format(i=i * 10 + j) for j in range(5))},
                    {"role": "assistant", "content": f"Try reordering the objects of module {i}."}]
    history.append({"role": "user", "content": "It still fails. What should I check next?"})
    next_turn = [*history, {"role": "assistant", "content": "Check the order of the libraries."},
                 {"role": "user", "content": "Done. Now what?"}]
    _serve(env, smollm2_path, port)
    try:
        client = OpenAI(base_url=url + "/v1", api_key="none")
        # The cold reference first, on a fresh server (nothing cached); the conversation so far then shares
        # its prefix (computing it again would only double the test's time).
        cold, cold_ttft, prompt, cached = _turn(client, next_turn, "reference")
        assert cached == 0 and prompt >= 3000
        _, _, history_tokens, _ = _turn(client, history, "agent")
        assert history_tokens >= 3000
    finally:
        stopped = _agentbox(env, "stop")
    assert stopped.returncode == 0, stopped.stderr
    log = (tmp_path / "server.log").read_text()
    assert "disk tier at stop:" in log, log[-3000:]  # the graceful stop says what the cache holds on disk
    _serve(env, smollm2_path, port)
    try:
        sessions = httpx.get(f"{url}/v1/sessions").json()["data"]
        agent = next(s for s in sessions if s["id"] == "agent")
        assert agent["turns"] == 1 and agent["on_disk_tokens"] > 3000  # back under its id, on disk
        top = Console(width=200, record=True)  # what `agentbox top` draws from the same JSON
        top.print(session_table.sessions_table(sessions))
        top.print(panels.pool_panel({"stats": httpx.get(f"{url}/v1/stats").json()}, 60))
        shown = top.export_text()
        assert "on disk" in shown and "torn 0" in shown, shown
        warm, warm_ttft, prompt, cached = _turn(client, next_turn, "agent")
        print(f"\nnext turn after a restart: {cached}/{prompt} tokens cached; time to first token "
              f"{warm_ttft:.2f} s vs {cold_ttft:.2f} s cold ({warm_ttft / cold_ttft:.2f}x)")
        assert cached >= 0.9 * prompt
        assert warm == cold
        stats = httpx.get(f"{url}/v1/stats").json()
        assert stats["cache"]["disk_restored"] * 16 >= cached
    finally:
        _agentbox(env, "stop")
