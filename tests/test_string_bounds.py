"""Length-bounded strings in tool schemas, as xgrammar compiles them after engine/grammar.py's rewrite: short
bounds are enforced without admitting raw control characters; a minimum alone or a long maximum (Claude Code's
Workflow script, 524,288) leaves a plain JSON string, escapes included."""

from __future__ import annotations

import json

import pytest

from agentbox.engine.grammar import MAX_STRING_BOUND, bounded_strings_as_patterns

xgr = pytest.importorskip("xgrammar")
from xgrammar.testing import _is_grammar_accept_string  # noqa: E402


def accepts(schema: dict, text: str) -> bool:
    grammar = xgr.Grammar.from_json_schema(bounded_strings_as_patterns(schema), any_whitespace=False,
                                           strict_mode=True)
    return _is_grammar_accept_string(grammar, text)


COMMAND = 'git commit -m "fix"\necho \\ done'


def test_a_minimum_alone_admits_quotes_and_newlines() -> None:
    schema = {"type": "string", "minLength": 1}
    assert accepts(schema, json.dumps(COMMAND))
    assert not accepts(schema, '"a\x15b"')  # still JSON: a raw control character is not


def test_a_short_maximum_is_enforced_without_raw_control_characters() -> None:
    schema = {"type": "string", "maxLength": 8}
    assert accepts(schema, json.dumps("abcdefgh"))
    assert not accepts(schema, json.dumps("abcdefghi"))
    assert not accepts(schema, '"a\x15b"')
    at_bound = {"type": "string", "minLength": 2, "maxLength": MAX_STRING_BOUND}
    assert accepts(at_bound, json.dumps("x" * MAX_STRING_BOUND)) and not accepts(at_bound, json.dumps("x"))


def test_a_long_maximum_is_left_to_the_client() -> None:
    workflow = {"type": "object", "properties": {"script": {"type": "string", "maxLength": 524288}},
                "required": ["script"], "additionalProperties": False}
    rewritten = bounded_strings_as_patterns(workflow)
    assert rewritten["properties"]["script"] == {"type": "string"}
    assert accepts(workflow, json.dumps({"script": COMMAND * 40}))
    assert bounded_strings_as_patterns({"type": "string", "maxLength": 4, "pattern": "^a+$"})["maxLength"] == 4
