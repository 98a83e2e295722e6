"""Fuzz the live server (SmolLM2, its real model name) with hypothesis: request bodies of all three APIs
built from our own request models' fields, each field drawn from valid values, edge values and junk (huge
integers, nan, wrong types, lone surrogates, deep nesting). Every answer is below 500 and JSON (or a stream
that ends), and the engine process is the same one at the end. Bounded: a fixed number of examples, each
generating at most a few tokens."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

MODEL = "SmolLM2-135M-Instruct.Q4_1"
pytestmark = pytest.mark.slow

JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.sampled_from([2**63, 2**64, -(2**63) - 1]),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([5e-324, 1e308, -0.0]),
    st.text(max_size=20), st.just("\ud800 x"), st.lists(st.integers(), max_size=3), st.just({"a": [[[[{}]]]]}),
)
SMALL = st.one_of(st.integers(1, 3), JUNK)  # max_tokens: a few tokens when valid, so the run stays short
FLOAT01 = st.one_of(st.floats(0, 1), JUNK)
TEXT = st.one_of(st.text(max_size=40), st.just("\ud800 x"), st.just("hi"))
CONTENT = st.one_of(TEXT, st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image", "x"]),
                                                          "text": TEXT}), max_size=2), JUNK)
MESSAGE = st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "assistant", "system", "tool"]), JUNK),
                                 "content": CONTENT})
TOOL = st.one_of(
    st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
        {"name": st.one_of(st.sampled_from(["get", "f"]), JUNK)},
        optional={"parameters": st.one_of(st.just({"type": "object"}), JUNK)})}),
    st.fixed_dictionaries({}, optional={"name": TEXT, "input_schema": st.one_of(st.just({"type": "object"}), JUNK)}),
    JUNK,
)
SAMPLING = {
    "temperature": st.one_of(st.floats(0, 2), JUNK), "top_p": FLOAT01, "top_k": st.one_of(st.integers(-1, 50), JUNK),
    "min_p": FLOAT01, "seed": st.one_of(st.integers(-(2**63), 2**63 - 1), JUNK),
    "presence_penalty": st.one_of(st.floats(-2, 2), JUNK), "frequency_penalty": JUNK,
    "repetition_penalty": st.one_of(st.floats(0.01, 10), JUNK), "stop": st.one_of(TEXT, st.lists(TEXT, max_size=3), JUNK),
    "stop_token_ids": st.one_of(st.lists(st.integers(0, 50000), max_size=3), JUNK), "logprobs": JUNK,
    "top_logprobs": st.one_of(st.integers(0, 5), JUNK), "session_id": st.one_of(TEXT, JUNK), "n": JUNK,
    "tool_choice": st.one_of(st.sampled_from(["auto", "none", "required"]), JUNK), "stream": st.booleans(),
    "response_format": st.one_of(st.just({"type": "json_object"}), JUNK), "tools": st.lists(TOOL, max_size=2),
}
MESSAGES = st.one_of(st.lists(MESSAGE, min_size=1, max_size=3), JUNK)


def body(core: dict) -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries({"model": st.one_of(st.just(MODEL), JUNK), **core},
                                 optional={k: v for k, v in SAMPLING.items() if k not in core})


REQUESTS = st.one_of(
    st.tuples(st.just("/v1/chat/completions"), body({"messages": MESSAGES, "max_tokens": SMALL})),
    st.tuples(st.just("/v1/completions"), body({
        "prompt": st.one_of(TEXT, st.lists(st.integers(-5, 2**40), max_size=4), JUNK), "max_tokens": SMALL})),
    st.tuples(st.just("/v1/messages"), body({"messages": MESSAGES, "max_tokens": SMALL})),
    st.tuples(st.just("/v1/messages/count_tokens"), body({"messages": MESSAGES})),
    st.tuples(st.just("/v1/responses"), body({"input": st.one_of(TEXT, st.lists(MESSAGE, max_size=2), JUNK),
                                                        "max_output_tokens": SMALL})),
)


def _encode(obj: dict) -> bytes:
    # allow_nan: Python's JSON parser (the server's) reads NaN / Infinity, so clients can send them.
    return json.dumps(obj, allow_nan=True).encode("utf-8", "surrogatepass")


@pytest.fixture(scope="module")
def engine_pid(live_server: str) -> int:
    return httpx.get(live_server + "/v1/stats", timeout=30).json()["engine_pid"]


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(req=REQUESTS)
def test_fuzzed_requests_never_5xx(live_server: str, engine_pid: int, req: tuple[str, dict]) -> None:
    path, obj = req
    with httpx.Client(base_url=live_server, timeout=120) as c, c.stream(
        "POST", path, content=_encode(obj), headers={"content-type": "application/json"}
    ) as r:
        text = r.read().decode("utf-8", "replace")
        assert r.status_code < 500, (path, obj, r.status_code, text[:500])
        if r.status_code >= 400:
            assert "error" in json.loads(text), text[:500]
        elif r.headers["content-type"].startswith("text/event-stream") and not path.endswith("/messages") \
                and path != "/v1/responses":
            assert text.rstrip().endswith("data: [DONE]"), text[-300:]


def test_engine_survived_the_fuzz(live_server: str, engine_pid: int) -> None:
    """Runs after the fuzz (same module, file order): the engine process is the one it started with."""
    deadline = time.monotonic() + 30
    while (r := httpx.get(live_server + "/health", timeout=30)).status_code != 200:
        assert time.monotonic() < deadline, r.text
        time.sleep(0.5)
    assert httpx.get(live_server + "/v1/stats", timeout=30).json()["engine_pid"] == engine_pid
