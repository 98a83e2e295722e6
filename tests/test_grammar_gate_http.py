"""No schema takes the machine down (issue 51's proof), against the shared live server (SmolLM2): a schema that
requires itself without end, one with a 100,000-member enum and a 2 MB one, on all four ways a schema comes in
(chat completions tools, response_format json_schema, Anthropic input_schema, Responses tools), 20 times in a
row each: every answer a 400 within 2 s that names where the schema is, the engine's RSS unchanged (within
50 MB), the same engine process serving afterwards. Before the gate, the recursive schema grew the engine to
16 GB in 33-53 s until the kernel's OOM killer ended it."""

from __future__ import annotations

import time

import httpx
import psutil
import pytest

MODEL = "SmolLM2-135M-Instruct.Q4_1"
pytestmark = pytest.mark.slow
HI = [{"role": "user", "content": "Call the tool."}]
RECURSIVE = {"type": "object", "properties": {"child": {"$ref": "#"}, "x": {"$ref": "#/properties/child"}},
             "required": ["child"]}
ENUM = {"type": "object", "properties": {"v": {"enum": [f"v{i}" for i in range(100_000)]}}, "required": ["v"]}
BIG = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "d" * 4000} for i in range(500)}}


def requests(schema: dict) -> list[tuple[str, dict]]:
    """(path, body) for each way a schema comes in, the call forced."""
    return [
        ("/v1/chat/completions", {"model": MODEL, "messages": HI, "max_tokens": 8, "tool_choice": "required",
                                  "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}]}),
        ("/v1/chat/completions", {"model": MODEL, "messages": HI, "max_tokens": 8, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}),
        ("/v1/messages", {"model": MODEL, "messages": HI, "max_tokens": 8, "tool_choice": {"type": "any"},
                          "tools": [{"name": "f", "input_schema": schema}]}),
        ("/v1/responses", {"model": MODEL, "input": "Call the tool.", "max_output_tokens": 8, "tool_choice": "required",
                           "tools": [{"type": "function", "name": "f", "parameters": schema}]}),
    ]


WHERE = {  # what each answer must name: where the schema is (a tool's schema that makes a prompt too long for the
    # 2048-token context is refused for its length first, naming the tool's schema)
    "recursive": ["tools[0].function.parameters.properties.child", "response_format.json_schema.schema.properties.child",
                  "tools[0].input_schema.properties.child", "tools[0].parameters.properties.child"],
    "enum": ["tools[0].function.parameters", "response_format.json_schema.schema.properties.v.enum",
             "tools[0].input_schema", "tools[0].parameters"],
    "big": ["tools[0].function.parameters", "response_format.json_schema.schema", "tools[0].input_schema",
            "tools[0].parameters"],
}


def engine(url: str) -> psutil.Process:
    return psutil.Process(httpx.get(url + "/v1/stats", timeout=60).json()["engine_pid"])


@pytest.mark.parametrize(("name", "schema"), [("recursive", RECURSIVE), ("enum", ENUM), ("big", BIG)])
def test_hostile_schemas_are_400s_and_cost_the_engine_nothing(live_server: str, name: str, schema: dict) -> None:
    proc = engine(live_server)
    rss = proc.memory_info().rss
    worst = 0.0
    with httpx.Client(base_url=live_server, timeout=60) as c:
        for _ in range(20):
            for (path, body), where in zip(requests(schema), WHERE[name], strict=True):
                t0 = time.monotonic()
                r = c.post(path, json=body)
                took = time.monotonic() - t0
                worst = max(worst, took)
                assert r.status_code == 400, (path, r.text[:500])
                assert took < 2.0, (path, took)
                assert where in r.json()["error"]["message"], (path, r.text[:500])
    grew = proc.memory_info().rss - rss
    print(f"\n{name}: 20 x 4 answers, all 400, slowest {worst:.2f} s; engine RSS {grew / 2**20:+.1f} MB")
    assert abs(grew) < 50 * 2**20
    assert engine(live_server).pid == proc.pid and httpx.get(live_server + "/health").json()["status"] == "ok"
    r = httpx.post(live_server + "/v1/chat/completions", timeout=120, json={  # a sound schema still decodes
        "model": MODEL, "messages": HI, "max_tokens": 24, "tool_choice": "required", "tools": [
            {"type": "function", "function": {"name": "f", "parameters": {
                "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}]})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["tool_calls"], r.text
