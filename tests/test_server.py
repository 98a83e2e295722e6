"""The HTTP API end to end: a real `agentbox serve` on loopback, driven by the official openai client."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

MODEL = "SmolLM2-135M-Instruct.Q4_1"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(live_server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=live_server + "/v1", api_key="unused", max_retries=0, timeout=120)


def stats(url: str) -> dict:
    return httpx.get(url + "/v1/stats", timeout=10).json()


def wait_idle(url: str, timeout: float = 30.0) -> dict:
    """Until no request runs and every page is back (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        s = stats(url)
        if s["running"] == 0 and s["waiting"] == 0 and s["pool"]["used_pages"] == s["cache"]["gpu_pages"]:
            return s
        if time.monotonic() > deadline:
            raise AssertionError(f"server did not go idle: {s}")
        time.sleep(0.2)


def test_models_health_version(live_server: str, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(live_server + "/health").json()["status"] == "ok"
    assert "version" in httpx.get(live_server + "/version").json()


def test_chat_non_streaming(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=16, temperature=0,
    )
    assert r.choices[0].message.role == "assistant"
    assert "Paris" in (r.choices[0].message.content or "")
    assert r.choices[0].finish_reason in ("stop", "length")
    u = r.usage
    assert u is not None and u.prompt_tokens > 0 and 0 < u.completion_tokens <= 16
    assert u.prompt_tokens_details is not None and isinstance(u.prompt_tokens_details.cached_tokens, int)


def test_chat_streaming_with_usage(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Count from one to five."}], max_tokens=20, temperature=0)
    full = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 0
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishes) == 1


def test_stop_strings_and_seed(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Count from one to ten."}], max_tokens=40, temperature=0)
    full = client.chat.completions.create(**kw).choices[0].message.content or ""
    assert len(full) > 10
    stop = full[5:8]
    cut = client.chat.completions.create(**kw, stop=[stop])
    assert cut.choices[0].message.content == full[: full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    a = client.chat.completions.create(**{**kw, "temperature": 1.0}, seed=7).choices[0].message.content
    b = client.chat.completions.create(**{**kw, "temperature": 1.0}, seed=7).choices[0].message.content
    assert a == b


def test_completions_with_logprobs(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp is not None and len(lp.tokens) == len(lp.token_logprobs) == r.usage.completion_tokens
    assert all(len(t) == 2 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == r.choices[0].text
    chunks = list(client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text


def test_eight_concurrent_requests(live_server: str) -> None:
    async def run() -> list[str]:
        c = openai.AsyncOpenAI(base_url=live_server + "/v1", api_key="x", max_retries=0, timeout=120)
        tasks = [
            c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"Say the number {i}."}],
                                      max_tokens=12, temperature=0)
            for i in range(8)
        ]
        rs = await asyncio.gather(*tasks)
        await c.close()
        return [r.choices[0].message.content or "" for r in rs]

    outs = asyncio.run(run())
    assert len(outs) == 8 and all(outs)
    wait_idle(live_server)


def test_disconnect_mid_stream_frees_pages(live_server: str) -> None:
    before = wait_idle(live_server)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long story."}], "max_tokens": 1500,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", live_server + "/v1/chat/completions", json=body, timeout=60) as r:
        got = 0
        for line in r.iter_lines():
            if line.startswith("data:"):
                got += 1
            if got == 4:
                assert stats(live_server)["running"] == 1  # mid-stream: it runs
                break  # leaving the iterator closes the connection: the client is gone
    after = wait_idle(live_server)  # the abort reached the engine and its pages came back
    assert after["pool"]["free_pages"] >= before["pool"]["free_pages"] - after["cache"]["gpu_pages"]
    assert after["counters"]["generated_tokens"] - before["counters"]["generated_tokens"] < 1500


def _post(url: str, body: object, raw: bytes | None = None) -> httpx.Response:
    if raw is not None:
        return httpx.post(url + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=60)


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"temperature": 3}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"presence_penalty": 5}, "presence_penalty"),
        ({"top_logprobs": 50, "logprobs": True}, "top_logprobs"),
        ({"min_p": -0.5}, "min_p"),
        ({"messages": []}, "messages"),
        ({"messages": [{"content": "no role"}]}, "messages[0].role"),
    ],
)
def test_bad_input_is_400_naming_the_field(live_server: str, patch: dict, param: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **patch}
    r = _post(live_server, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"]


def test_unknown_model_is_404_naming_the_served_names(live_server: str) -> None:
    r = _post(live_server, {"model": "gpt-17", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert err["param"] == "model" and err["code"] == "model_not_found" and "'default'" in err["message"]


def test_malformed_json_and_long_prompt(live_server: str, client: openai.OpenAI) -> None:
    r = _post(live_server, None, raw=b'{"model": "x", "messages": [')
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    long_text = "word " * 3000
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": long_text}], max_tokens=4)
    msg = e.value.body["message"] if isinstance(e.value.body, dict) else str(e.value)
    # Both numbers: the prompt's length and the context.
    assert "context is 2048 tokens" in msg and int(re.search(r"prompt is (\d+) tokens", msg).group(1)) > 3000
    # ...and the server keeps serving.
    ok = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert ok.choices[0].message.content is not None


def _cli(home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "AGENTBOX_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "agentbox.cli.main", *args], env=env, capture_output=True, text=True, timeout=60)


def test_daemon_status_second_serve_and_logs(live_server: str, agentbox_home: Path) -> None:
    st = _cli(agentbox_home, "status", "--json")
    info = json.loads(st.stdout)
    assert info["running"] and info["healthy"] and info["url"] == live_server and info["model"] == MODEL
    again = _cli(agentbox_home, "serve", "--port", "1")
    assert again.returncode != 0 and "already serves" in again.stderr and str(info["pid"]) in again.stderr
    logs = _cli(agentbox_home, "logs", "-n", "200")
    assert logs.returncode == 0 and "POST /v1/chat/completions" in logs.stdout
