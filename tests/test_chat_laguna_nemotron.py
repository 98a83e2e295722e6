"""The tool-call formats of Laguna XS.2's and Nemotron 3 Nano's own chat templates (tests/fixtures, as llama.cpp
vendors them): the parser detected from each template is the one its profile names, and it reads a call written
the way the template renders one back into the same name and arguments."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentbox.chat.tool_parsers import detect_tool_parser, get_tool_parser
from agentbox.hub.profiles import find_profile

FIXTURES = Path(__file__).parent / "fixtures"
TOOLS = [{"type": "function", "function": {"name": "run", "parameters": {
    "type": "object", "properties": {"cmd": {"type": "string"}, "n": {"type": "integer"}}}}}]
CALLS = {  # what each template renders for run(cmd="ls -la", n=3)
    "laguna_xs2": "<tool_call>run\n<arg_key>cmd</arg_key>\n<arg_value>ls -la</arg_value>\n<arg_key>n</arg_key>\n"
                  "<arg_value>3</arg_value>\n</tool_call>\n",
    "nemotron3_nano": "<tool_call>\n<function=run>\n<parameter=cmd>\nls -la\n</parameter>\n<parameter=n>\n3\n"
                      "</parameter>\n</function>\n</tool_call>\n",
}
PROFILES = {"laguna_xs2": "laguna-xs2", "nemotron3_nano": "nemotron-3.5-lightning"}


@pytest.mark.parametrize("name", list(CALLS))
def test_template_tool_calls_parse(name: str) -> None:
    template = (FIXTURES / f"{name}_chat_template.jinja").read_text()
    parser = detect_tool_parser(template)
    assert parser == find_profile(PROFILES[name]).tool_parser
    out = get_tool_parser(parser, TOOLS).parse("Running it.\n" + CALLS[name])
    assert out.content == "Running it."
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("run", {"cmd": "ls -la", "n": 3})]
