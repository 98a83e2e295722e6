"""Tool-call parsers on realistic outputs of each family, streamed split at every position."""

from __future__ import annotations

import json

import pytest

from agentbox.chat.tool_parsers import collect, detect_tool_parser, get_tool_parser

WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"},
                    "hours": {"type": "array", "items": {"type": "integer"}},
                },
            },
        },
    },
    {"type": "function", "function": {"name": "list_files", "parameters": {"type": "object", "properties": {}}}},
]

# (parser, model output, expected content, expected [(name, arguments dict)])
CASES = [
    (
        "hermes",
        'Let me check.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
        '</tool_call>\n<tool_call>\n{"name": "list_files", "arguments": {}}\n</tool_call>',
        "Let me check.",
        [("get_weather", {"city": "Paris", "days": 3}), ("list_files", {})],
    ),
    (
        "hermes",
        '<tool_call>\n{"name": "list_files"}\n</tool_call>',
        "",
        [("list_files", {})],
    ),
    (
        "hermes",
        'No tools needed: 1 < 2 and <tool is not a tag. {"name": "x"} stays text.',
        'No tools needed: 1 < 2 and <tool is not a tag. {"name": "x"} stays text.',
        [],
    ),
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}\n</tool_call>',
        "",
        [("get_weather", {"city": "Oslo"})],
    ),
    (
        "qwen3_coder",
        "I'll look it up.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n"
        "<parameter=days>\n5\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n<parameter=hours>\n[1, 2]\n"
        "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=list_files>\n</function>\n</tool_call>",
        "I'll look it up.",
        [("get_weather", {"city": "San Francisco", "days": 5, "metric": True, "hours": [1, 2]}), ("list_files", {})],
    ),
    (
        "qwen3_coder",  # a dropped </parameter> is ended by the next tag
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n<parameter=days>\n2\n</function>\n</tool_call>",
        "",
        [("get_weather", {"city": "Oslo", "days": 2})],
    ),
    (
        "glm45",
        "Checking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Beijing</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>",
        "Checking.",
        [("get_weather", {"city": "Beijing", "days": 2})],
    ),
    (
        "glm45",  # GLM-4.7: no newlines, and a zero-argument call
        "<tool_call>list_files</tool_call><tool_call>get_weather<arg_key>city</arg_key><arg_value>Rome"
        "</arg_value><arg_key>metric</arg_key><arg_value>false</arg_value></tool_call>",
        "",
        [("list_files", {}), ("get_weather", {"city": "Rome", "metric": False})],
    ),
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Lima", "hours": [6, 18]}}',
        "",
        [("get_weather", {"city": "Lima", "hours": [6, 18]})],
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "list_files", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "Kyiv"}}',
        "",
        [("list_files", {}), ("get_weather", {"city": "Kyiv"})],
    ),
    (
        "llama3_json",
        "The weather in {city} is fine.",
        "The weather in {city} is fine.",
        [],
    ),
    (
        "mistral",
        'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Nice"}}, {"name": "list_files", "arguments": {}}]',
        "Sure.",
        [("get_weather", {"city": "Nice"}), ("list_files", {})],
    ),
    (
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Lyon", "days": 1}[TOOL_CALLS]list_files[ARGS]{}',
        "",
        [("get_weather", {"city": "Lyon", "days": 1}), ("list_files", {})],
    ),
]


def _summary(parsed):
    return parsed.content, [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_parse(parser: str, text: str, content: str, calls: list) -> None:
    out = get_tool_parser(parser, WEATHER_TOOLS).parse(text)
    assert _summary(out) == (content, calls)
    for c in out.tool_calls:
        assert c.id.startswith("call_") and len(c.id) == 5 + 24


@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_stream_split_everywhere(parser: str, text: str, content: str, calls: list) -> None:
    p = get_tool_parser(parser, WEATHER_TOOLS)
    whole = p.parse(text)
    splits = [[text[:cut], text[cut:]] for cut in range(len(text) + 1)]
    splits.append([text[i : i + 3] for i in range(0, len(text), 3)])
    splits.append(list(text))
    for cut, pieces in enumerate(splits):
        s = p.stream()
        deltas = []
        for piece in pieces:
            deltas += s.feed(piece)
        deltas += s.finish()
        got = collect(deltas)
        assert (got.content, [(c.name, c.arguments) for c in got.tool_calls]) == (
            whole.content,
            [(c.name, c.arguments) for c in whole.tool_calls],
        ), f"split at {cut}"
        _check_delta_shape(deltas)


def _check_delta_shape(deltas) -> None:
    """OpenAI's order: per call, the first delta has id + name, later ones carry arguments only."""
    seen: set[int] = set()
    last_index = -1
    for d in deltas:
        assert d.content != ""
        tc = d.tool_call
        if tc is None:
            continue
        if tc.index not in seen:
            assert tc.id is not None and tc.name and tc.index == last_index + 1
            seen.add(tc.index)
            last_index = tc.index
        else:
            assert tc.id is None and tc.name is None and tc.arguments
        assert d.to_openai()["tool_calls"][0]["index"] == tc.index


def test_markup_never_leaks_while_streaming() -> None:
    s = get_tool_parser("hermes").stream()
    shown = "".join(d.content or "" for d in s.feed("Hi <tool_"))
    assert shown == "Hi"
    shown += "".join(d.content or "" for d in s.feed("box> ok"))
    shown += "".join(d.content or "" for d in s.finish())
    assert shown == "Hi <tool_box> ok"


def test_arguments_stream_piece_by_piece() -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
    s = get_tool_parser("hermes").stream()
    arg_deltas = [d.tool_call.arguments for ch in text for d in s.feed(ch) if d.tool_call and d.tool_call.id is None]
    assert len(arg_deltas) > 5 and "".join(arg_deltas) == '{"city": "Paris", "days": 3}'


def test_xml_values_stay_strings_without_schema() -> None:
    out = get_tool_parser("qwen3_coder").parse(
        "<tool_call>\n<function=f>\n<parameter=n>\n5\n</parameter>\n</function>\n</tool_call>"
    )
    assert json.loads(out.tool_calls[0].arguments) == {"n": "5"}


def test_detect_from_template() -> None:
    assert detect_tool_parser("{{ '<tool_call>\\n<function=' }}<parameter=") == "qwen3_coder"
    assert detect_tool_parser("<tool_call>{{ name }}<arg_key>") == "glm45"
    assert detect_tool_parser("{{ '<tool_call>\\n' }}{{ tool_call | tojson }}") == "hermes"
    assert detect_tool_parser("[TOOL_CALLS]") == "mistral"
    assert detect_tool_parser("<|python_tag|>") == "llama3_json"
    assert detect_tool_parser("{{ message.content }}") is None
    with pytest.raises(ValueError):
        get_tool_parser("nonesuch")


def test_malformed_block_returns_to_content() -> None:
    text = "Before <tool_call>not json at all</tool_call> after"
    p = get_tool_parser("hermes")
    whole = p.parse(text)
    assert whole.tool_calls == [] and whole.content == "Before <tool_call>not json at all</tool_call> after"
    for cut in range(len(text) + 1):
        s = p.stream()
        got = collect(s.feed(text[:cut]) + s.feed(text[cut:]) + s.finish())
        assert got.content == whole.content and not s.has_tool_calls
