"""No request takes the server down, no web page can drive it, and every failure is a typed JSON answer:
against the shared live server (SmolLM2), whose engine process must be the same one after each test."""

from __future__ import annotations

import json
import socket
import threading
import time
from urllib.parse import urlparse

import httpx
import pytest

MODEL = "SmolLM2-135M-Instruct.Q4_1"
pytestmark = pytest.mark.slow
HI = [{"role": "user", "content": "hi"}]


def stats(url: str) -> dict:
    """The engine's stats (a query waits for the step in progress: a long prefill step can outlast its
    timeout on a loaded CPU, a 503 then; asked again)."""
    for _ in range(10):
        r = httpx.get(url + "/v1/stats", timeout=30)
        if r.status_code == 200:
            return r.json()
        assert r.status_code == 503 and r.headers["retry-after"], r.text
    raise AssertionError(r.text)


@pytest.fixture
def same_engine(live_server: str):  # noqa: ANN201 - asserts the engine survived the test
    pid = stats(live_server)["engine_pid"]
    yield
    assert stats(live_server)["engine_pid"] == pid, "the engine process was restarted"
    assert httpx.get(live_server + "/health").json()["status"] == "ok"


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"messages": HI, "seed": 18446744073709551616}, "seed"),
    ("/v1/chat/completions", {"messages": HI, "top_k": 9223372036854775808}, "top_k"),
    ("/v1/completions", {"prompt": "hi", "repetition_penalty": 5e-324}, "repetition_penalty"),
    ("/v1/chat/completions", {"messages": HI, "stop_token_ids": [2**70]}, "stop_token_ids[0]"),
    ("/v1/chat/completions", {"messages": HI, "max_tokens": 2**64}, "max_tokens"),
    ("/v1/completions", {"prompt": [2**40]}, "prompt"),
    ("/v1/chat/completions", {"messages": HI, "session_id": "s" * 5000}, "session_id"),
])
def test_crash_values_are_400_naming_the_field(live_server: str, same_engine: None, path: str, body: dict,
                                               param: str) -> None:
    r = httpx.post(live_server + path, json={"model": MODEL, "max_tokens": 4, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"].startswith(param) and err["message"]


def test_nan_and_anthropic_bounds(live_server: str, same_engine: None) -> None:
    raw = b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}' % MODEL.encode()
    r = httpx.post(live_server + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    r = httpx.post(live_server + "/v1/messages", json={"model": MODEL, "max_tokens": 4, "messages": HI,
                                                       "top_k": 2**63})
    assert r.status_code == 400 and r.json()["type"] == "error" and "top_k" in r.json()["error"]["message"]


def _deep(n: int) -> str:
    return "[" * n + "]" * n


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens", "/v1/chat/completions"])
def test_deep_nesting_and_lone_surrogates_are_400(live_server: str, same_engine: None, path: str) -> None:
    head = f'{{"model": "{MODEL}", "max_tokens": 4, "messages": '
    for raw in (head + _deep(10_000) + "}", head + '[{"role": "user", "content": "\\ud800 x"}]}'):
        r = httpx.post(live_server + path, content=raw.encode(), headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        msg = r.json()["error"]["message"]
        assert "nested" in msg or "surrogate" in msg


def test_tool_without_name_is_400(live_server: str, same_engine: None) -> None:
    r = httpx.post(live_server + "/v1/chat/completions", json={
        "model": MODEL, "messages": HI, "max_tokens": 4,
        "tools": [{"type": "function", "function": {"parameters": {"type": "object"}}}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools" and "name" in r.json()["error"]["message"]
    r = httpx.post(live_server + "/v1/messages", json={"model": MODEL, "messages": HI, "max_tokens": 4,
                                                       "tools": [{"input_schema": {"type": "object"}}]})
    assert r.status_code == 400 and "name" in r.json()["error"]["message"]


def test_cross_site_post_and_foreign_host_are_refused(live_server: str, same_engine: None) -> None:
    body = json.dumps({"model": MODEL, "messages": HI, "max_tokens": 4})
    # What a page's fetch() or form sends without a CORS preflight.
    for ctype in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {"content-type": ctype} if ctype else {}
        r = httpx.post(live_server + "/v1/messages", content=body.encode(), headers=headers)
        assert r.status_code == 415, r.text
        assert "Content-Type: application/json" in r.json()["error"]["message"]
        r = httpx.post(live_server + "/v1/chat/completions", content=body.encode(), headers=headers)
        assert r.status_code == 415 and "Content-Type: application/json" in r.json()["error"]["message"]
    # DNS rebinding: the page's name resolves to 127.0.0.1, its Host header stays its own.
    r = httpx.get(live_server + "/v1/sessions", headers={"host": "evil.example"})
    assert r.status_code == 421 and "evil.example" in r.json()["error"]["message"]
    port = urlparse(live_server).port
    assert httpx.get(live_server + "/v1/sessions", headers={"host": f"localhost:{port}"}).status_code == 200
    r = httpx.options(live_server + "/v1/chat/completions", headers={
        "origin": "https://evil.example", "access-control-request-method": "POST"})
    assert "access-control-allow-origin" not in r.headers  # CORS is off unless serve is asked for it


def test_oversized_body_and_prompt_are_refused_before_work(live_server: str, same_engine: None) -> None:
    big = b'{"model": "x", "prompt": "' + b"a" * (33 * 2**20) + b'"}'
    r = httpx.post(live_server + "/v1/completions", content=big, headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 413 and "MiB" in r.json()["error"]["message"]
    # 4 MB of text: refused from its length alone, before the tokenizer sees it.
    r = httpx.post(live_server + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "word " * 800_000}]})
    assert r.status_code == 400 and "at least" in r.json()["error"]["message"]


def _wait(url: str, pred, timeout: float = 30.0) -> dict:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while True:
        s = stats(url)
        if pred(s):
            return s
        assert time.monotonic() < deadline, s
        time.sleep(0.05)


def test_abandoned_non_streaming_request_frees_its_pages(live_server: str, same_engine: None) -> None:
    idle = _wait(live_server, lambda s: s["running"] == 0 and s["waiting"] == 0)
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Write a long story."}],
                       "max_tokens": 1500, "temperature": 0, "ignore_eos": True}).encode()
    u = urlparse(live_server)
    sock = socket.create_connection((u.hostname, u.port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    _wait(live_server, lambda s: s["running"] == 1 and s["counters"]["generated_tokens"]
          > idle["counters"]["generated_tokens"] + 4)
    sock.close()  # the client gives up without reading its answer
    gone = time.monotonic()
    after = _wait(live_server, lambda s: s["running"] == 0 and s["pool"]["used_pages"] == s["cache"]["gpu_pages"])
    took = time.monotonic() - gone
    generated = after["counters"]["generated_tokens"] - idle["counters"]["generated_tokens"]
    assert generated < 1500, "the abandoned request ran to max_tokens"
    print(f"abandoned request: pages back {took:.2f} s after the client left, {generated} tokens generated")


def test_sessions_routes_and_metrics_answer_json_or_text(live_server: str) -> None:
    r = httpx.get(live_server + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    spec = httpx.get(live_server + "/openapi.json").json()
    msgs = spec["paths"]["/v1/messages"]["post"]
    assert "requestBody" in msgs and "400" in msgs["responses"] and "422" not in json.dumps(spec["paths"])
    assert "text/plain" in spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]


def test_concurrent_bad_and_good_requests(live_server: str, same_engine: None) -> None:
    """Bad requests mixed into good ones under load: each bad one is a 4xx, each good one a 200."""
    results: list[int] = []

    def one(i: int) -> None:
        bad = i % 2 == 1
        body = {"model": MODEL, "messages": HI, "max_tokens": 4, **({"seed": 2**64} if bad else {})}
        results.append(httpx.post(live_server + "/v1/chat/completions", json=body, timeout=120).status_code)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [200] * 4 + [400] * 4


def test_grammar_error_names_the_reason_without_cpp_paths(live_server: str, same_engine: None) -> None:
    r = httpx.post(live_server + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": HI, "max_tokens": 4,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}})
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert "Unsupported type" in msg and ".cc" not in msg and "/project" not in msg
