"""server/fast_json.py decodes exactly what the stdlib decodes and refuses what it refuses, with its words."""

from __future__ import annotations

import json

import pytest

from agentbox.server.fast_json import loads


@pytest.mark.parametrize("body", [
    b'{"model": "m", "messages": [{"role": "user", "content": "h\\u00e9llo \\ud83d\\ude00"}], "max_tokens": 3}',
    b'{"x": NaN, "y": Infinity}',  # orjson refuses these; the stdlib (and so FastAPI before) accepts them
    b'[1.5e300, -0.0, true, null]',
])
def test_same_values_as_the_stdlib(body: bytes) -> None:
    assert json.dumps(loads(body)) == json.dumps(json.loads(body))


def test_errors_are_the_stdlib_errors() -> None:
    with pytest.raises(json.JSONDecodeError) as ours:
        loads(b'{"model": "m", "messages": [')
    with pytest.raises(json.JSONDecodeError) as std:
        json.loads(b'{"model": "m", "messages": [')
    assert (ours.value.msg, ours.value.pos) == (std.value.msg, std.value.pos)
