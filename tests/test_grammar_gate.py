"""The grammar gate (server/grammar_gate.py) and its compile worker (engine/grammar_worker.py) with SmolLM2's real
tokenizer and xgrammar: static limits named by path, compile errors named by the schema they come from, verdicts
kept (a repeated schema costs no compile), a compile past its deadline killed, and a grammar that forces an
endless output stopped by the worker's address-space cap instead of growing until the machine's end."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from agentbox.chat.grammar import grammar_spec
from agentbox.chat.schema_check import SchemaRefused, check_schema
from agentbox.engine.grammar_worker import MEMORY, WHOLE
from agentbox.server.errors import APIError
from agentbox.server.grammar_gate import GrammarGate

RECURSIVE = {"type": "object", "properties": {"child": {"$ref": "#"}, "x": {"$ref": "#/properties/child"}},
             "required": ["child"]}


def _tools(*schemas: dict) -> list[dict]:
    return [{"type": "function", "function": {"name": f"f{i}", "parameters": s}} for i, s in enumerate(schemas)]


def _param(i: int) -> str:
    return f"tools[{i}].function.parameters" if i >= 0 else "response_format.json_schema.schema"


@pytest.mark.parametrize(("schema", "where", "why"), [
    (RECURSIVE, ".properties.child", "requires the schema again without end"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/n"}}, "$defs": {"n": {
        "type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"]}}},
     ".properties.a.properties.next", "requires the schema again without end"),  # optional, yet endless once open
    ({"type": "array", "minItems": 1, "items": {"$ref": "#"}}, ".items", "requires the schema again"),
    ({"properties": {"v": {"enum": list(range(5000))}}}, ".properties.v.enum", "5,000 members"),
    ({"properties": {f"p{i}": {} for i in range(1001)}}, ".properties", "1,001 properties"),
    ({"type": "array", "minItems": 100_000, "items": {"type": "integer"}}, "", "longer than 65,536"),
])
def test_static_limits_name_the_path(schema: dict, where: str, why: str) -> None:
    with pytest.raises(SchemaRefused) as e:
        check_schema(schema, "p")
    assert e.value.path == "p" + where and why in e.value.reason


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}, "required": ["next"]},
    {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}, "required": ["kids"]},
    {"$defs": {"a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
               "b": {"anyOf": [{"$ref": "#/$defs/a"}, {"type": "string"}]}}, "$ref": "#/$defs/a"},
    {"type": "object", "properties": {"path": {"type": "string"}, "mode": {"enum": ["r", "w"]}}, "required": ["path"]},
])
def test_recursion_a_value_can_leave_is_fine(schema: dict) -> None:
    check_schema(schema, "p")


@pytest.mark.slow
def test_verdicts_are_kept_and_compiles_are_bounded(smollm2_path: Path) -> None:
    gate = GrammarGate(str(smollm2_path), 49152, [2])

    async def admit(spec: object) -> APIError | None:
        try:
            await gate.admit(spec, _param)  # type: ignore[arg-type]
        except APIError as e:
            return e
        return None

    try:
        ok = grammar_spec(_tools({"type": "object", "properties": {"a": {"type": "string"}}}), "required", None,
                          "hermes")
        assert asyncio.run(admit(ok)) is None and gate.compiles == 1
        assert asyncio.run(admit(ok)) is None and gate.compiles == 1  # kept: no second compile
        bad = grammar_spec(_tools({"type": "object"}, {"type": "object", "properties": {"a": {"type": "foo"}}}),
                           "required", None, "hermes")
        e = asyncio.run(admit(bad))
        assert e is not None and e.status == 400 and e.param == "tools[1].function.parameters"
        assert "Unsupported type" in e.message and ".cc" not in e.message
        t0 = time.monotonic()
        assert asyncio.run(admit(bad)) is not None and gate.compiles == 2  # refused again, from the verdicts
        assert time.monotonic() - t0 < 0.1
        hostile = grammar_spec(_tools(RECURSIVE), "required", None, "hermes")
        e = asyncio.run(admit(hostile))
        assert e is not None and e.param == "tools[0].function.parameters.properties.child" and gate.compiles == 2
    finally:
        gate.close()


@pytest.mark.slow
def test_the_worker_is_capped_in_memory_and_time(smollm2_path: Path) -> None:
    """Past the static limits (as a gap in them would let it), the recursive schema reaches the worker: its
    forced output grows until the address-space cap stops it (a fatal verdict; the worker is replaced); a compile
    past the deadline is killed."""
    gate = GrammarGate(str(smollm2_path), 49152, [2], compile_s=60.0, memory_bytes=512 * 2**20)
    try:
        t0 = time.monotonic()
        verdict = gate.compile(grammar_spec(_tools(RECURSIVE), "required", None, "hermes"))
        assert verdict is not None and verdict.message == MEMORY and verdict.fatal, verdict
        print(f"\nthe endless grammar stopped at the worker's cap after {time.monotonic() - t0:.1f} s")
        ok = grammar_spec(_tools({"type": "object"}), "required", None, "hermes")
        assert gate.compile(ok) is None  # a fresh worker
        gate.compile_s = 0.0  # nothing compiles in no time
        slow = gate.compile(grammar_spec(_tools({"type": "object", "properties": {"b": {}}}), "required", None,
                                         "hermes"))
        assert slow is not None and slow.schema == WHOLE and "takes longer than" in slow.message
    finally:
        gate.close()
