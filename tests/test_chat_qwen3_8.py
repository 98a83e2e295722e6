"""Qwen3.8 on its released chat template: the request shapes agents send render, the effort defaults to medium,
and the template's own XML tool calls parse back to the arguments they were written from.

The template is tests/fixtures/qwen3_8/chat_template.jinja, copied byte for byte from the official Qwen3.8 chat
template as quoted in modal-projects/sglang, modal_deployments/qwen38_max_nvfp4_rtn_mtp_8xb300/serve.py
(commit ea6d3528a4675228c5b10438cec8b05047205982, `OFFICIAL_CHAT_TEMPLATE`, "Qwen/Qwen3.8-2.4T-A95B rev
9d060ae8"). The 27B's own tokenizer_config was not found offline; the family shares this template (the
unsloth 27B GGUF's template is this text with its system-message fixes patched in)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from jinja2.exceptions import TemplateError

from agentbox.chat.effort import ReasoningEffort, fit_to_template, template_levels
from agentbox.chat.render import prepare_messages, render_prompt
from agentbox.chat.tool_parsers import detect_tool_parser, get_tool_parser
from agentbox.hub.profiles import find_profile

TEMPLATE = (Path(__file__).parent / "fixtures" / "qwen3_8" / "chat_template.jinja").read_text()
XHIGH_TEXT = "Reasoning effort is set to xhigh."
LOW_TEXT = "Reasoning effort is set to low."

TOOLS = [
    {"type": "function", "function": {"name": "Bash", "description": "Run a shell command.", "parameters": {
        "type": "object", "properties": {"command": {"type": "string"}, "timeout": {"type": "integer"},
                                         "run_in_background": {"type": "boolean"}},
        "required": ["command"]}}},
    {"type": "function", "function": {"name": "Edit", "description": "Replace text in a file.", "parameters": {
        "type": "object", "properties": {"file_path": {"type": "string"}, "old_string": {"type": "string"},
                                         "new_string": {"type": "string"}, "replace_all": {"type": "boolean"}},
        "required": ["file_path", "old_string", "new_string"]}}},
    {"type": "function", "function": {"name": "TodoWrite", "description": "Write the todo list.", "parameters": {
        "type": "object", "properties": {"todos": {"type": "array", "items": {"type": "object", "properties": {
            "content": {"type": "string"}, "status": {"type": "string"}, "id": {"type": "string"}}}}},
        "required": ["todos"]}}},
    {"type": "function", "function": {"name": "Configure", "description": "Set options.", "parameters": {
        "type": "object", "properties": {"options": {"type": "object"}, "ratio": {"type": "number"},
                                         "note": {"type": "string"}}}}},
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer):  # noqa: ANN001, ANN201 - SmolLM2's tokens, Qwen3.8's template
    tok = copy.copy(smollm2_tokenizer)
    tok.chat_template = TEMPLATE
    return tok


def claude_code_request() -> list[dict[str, Any]]:
    """What Claude Code's Anthropic request becomes (server/anthropic_routes.py to_messages): the system prompt,
    a task, a call and its result, a system reminder mid-session, and a turn that carries only tool results."""
    return [
        {"role": "system", "content": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=9;"},
                                       {"type": "text", "text": "You are Claude Code, a coding agent."}]},
        {"role": "user", "content": "The tests in tests/test_a.py fail; fix them."},
        {"role": "assistant", "content": "", "reasoning_content": "Run the tests first.", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "Bash", "arguments": '{"command": "pytest -q"}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "1 failed: assert f(2) == 4"},
        {"role": "system", "content": "<system-reminder>The todo list is empty.</system-reminder>"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "t2", "type": "function", "function": {"name": "Bash", "arguments": '{"command": "cat a.py"}'}},
            {"id": "t3", "type": "function", "function": {"name": "Bash", "arguments": '{"command": "cat b.py"}'}}]},
        {"role": "tool", "tool_call_id": "t2", "content": "def f(x):\n    return x + x + 1"},
        {"role": "tool", "tool_call_id": "t3", "content": ""},
    ]


def test_the_released_template_refuses_what_agents_send(tokenizer) -> None:  # noqa: ANN001
    """The template as shipped, without our rewrites: the two 400s users hit (the test can fail)."""
    msgs = prepare_messages(claude_code_request(), TEMPLATE)
    with pytest.raises(TemplateError, match="System message must be at the beginning"):
        tokenizer.apply_chat_template(msgs, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    tool_only = [{"role": "assistant", "content": "", "tool_calls": msgs[2]["tool_calls"]}, msgs[3]]
    with pytest.raises(TemplateError, match="No user query found"):
        tokenizer.apply_chat_template(tool_only, tools=TOOLS, tokenize=False, add_generation_prompt=True)


def test_claude_code_request_with_late_system_and_tool_only_turn_renders(tokenizer) -> None:  # noqa: ANN001
    text = render_prompt(tokenizer, claude_code_request(), TOOLS, reasoning_effort=ReasoningEffort.MEDIUM,
                         tool_parser="qwen3_coder")
    assert text.startswith("<|im_start|>system\n# Tools\n\nYou have access to the following functions:")
    assert "You are Claude Code, a coding agent.<|im_end|>" in text and "billing-header" not in text
    # The late reminder stays where it was sent, as a user turn; the first system turn does not change.
    reminder = "<|im_start|>user\n<system-reminder>The todo list is empty.</system-reminder><|im_end|>\n"
    assert text.count("<|im_start|>system") == 1 and reminder in text
    assert text.index("1 failed") < text.index(reminder) < text.index("cat a.py")
    # The tool-only turn: both results in one user turn, as the template writes tool messages.
    assert ("<|im_start|>user\n<tool_response>\ndef f(x):\n    return x + x + 1\n</tool_response>\n"
            "<tool_response>\n\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n") in text
    assert XHIGH_TEXT not in text and LOW_TEXT not in text  # medium: the template adds no instruction


def test_a_conversation_without_a_user_query_opens_with_an_empty_user_turn(tokenizer) -> None:  # noqa: ANN001
    resumed = claude_code_request()[2:4]  # a sub-agent resumed from its tool results: no user query at all
    text = render_prompt(tokenizer, resumed, TOOLS, tool_parser="qwen3_coder")
    assert "<|im_end|>\n<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n" in text
    # The next turn, with a user query after it, gets the same opening: its prompt extends this one.
    later = [*resumed, {"role": "assistant", "content": "Found it."}, {"role": "user", "content": "Fix it."}]
    before = render_prompt(tokenizer, resumed, TOOLS, tool_parser="qwen3_coder", add_generation_prompt=False)
    assert render_prompt(tokenizer, later, TOOLS, tool_parser="qwen3_coder").startswith(before)


def test_every_turn_extends_the_last_across_a_late_system_message(tokenizer) -> None:  # noqa: ANN001
    """Prefix stability: merging the reminder into the first system turn would rewrite the prompt's start."""
    full = claude_code_request()
    for a, b in ((2, 4), (4, 5), (5, 8)):  # where a turn's new messages end (parallel results arrive together)
        before = render_prompt(tokenizer, full[:a], TOOLS, tool_parser="qwen3_coder", add_generation_prompt=False)
        after = render_prompt(tokenizer, full[:b], TOOLS, tool_parser="qwen3_coder", add_generation_prompt=False)
        assert after.startswith(before), (a, b)


def test_effort_defaults_to_the_profile_and_maps_onto_the_template_levels(tokenizer) -> None:  # noqa: ANN001
    prof = find_profile("Qwen3.8-27B")
    assert prof.reasoning_effort is ReasoningEffort.MEDIUM
    assert template_levels(TEMPLATE) == {ReasoningEffort.LOW, ReasoningEffort.MEDIUM, ReasoningEffort.XHIGH}
    assert fit_to_template(ReasoningEffort.HIGH, TEMPLATE) is ReasoningEffort.XHIGH
    assert fit_to_template(ReasoningEffort.MAX, TEMPLATE) is ReasoningEffort.XHIGH
    assert fit_to_template(ReasoningEffort.MINIMAL, TEMPLATE) is ReasoningEffort.LOW
    msgs = [{"role": "user", "content": "hi"}]
    assert XHIGH_TEXT in render_prompt(tokenizer, msgs)  # the template alone: xhigh
    assert XHIGH_TEXT in render_prompt(tokenizer, msgs, reasoning_effort=ReasoningEffort.HIGH)
    assert LOW_TEXT in render_prompt(tokenizer, msgs, reasoning_effort=ReasoningEffort.LOW)
    medium = render_prompt(tokenizer, msgs, reasoning_effort=ReasoningEffort.MEDIUM)
    assert medium == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    off = render_prompt(tokenizer, msgs, enable_thinking=False, reasoning_effort=ReasoningEffort.NONE)
    assert off.endswith("<think>\n\n</think>\n\n")


# 20 calls shaped as agents make them: nested JSON, strings with `<` and XML-looking text, empty values,
# multi-line code, unicode, numbers and booleans.
CALLS: list[tuple[str, dict[str, Any]]] = [
    ("Bash", {"command": "ls -la"}),
    ("Bash", {"command": "grep -rn 'a < b' src/ | head -5", "timeout": 120000}),
    ("Bash", {"command": "echo '<tool_call>' > /dev/null && cat <<EOF\nx < y\nEOF", "run_in_background": False}),
    ("Bash", {"command": ""}),
    ("Edit", {"file_path": "/repo/a.py", "old_string": "return x + x + 1", "new_string": "return x + x"}),
    ("Edit", {"file_path": "/repo/page.html", "old_string": "<div class=\"a\">\n  <p>old</p>\n</div>",
              "new_string": "<div class=\"a\">\n  <p>new &amp; better</p>\n</div>"}),
    ("Edit", {"file_path": "/repo/t.py", "old_string": "if a<b and c>d:\n    pass",
              "new_string": "if a <= b:\n    return\n", "replace_all": True}),
    ("Edit", {"file_path": "/repo/empty.txt", "old_string": "", "new_string": "first line"}),
    ("Edit", {"file_path": "/repo/gen.py", "old_string": "x = 1",
              "new_string": "template = '<parameter=path>'  # the call syntax as a string"}),
    ("Edit", {"file_path": "/repo/ü.md", "old_string": "café → naïve", "new_string": "日本語 <b>ok</b>"}),
    ("TodoWrite", {"todos": [{"content": "Run tests", "status": "in_progress", "id": "1"},
                             {"content": "Fix f()", "status": "pending", "id": "2"}]}),
    ("TodoWrite", {"todos": []}),
    ("TodoWrite", {"todos": [{"content": "Check a < b and b > c", "status": "done", "id": "3"}]}),
    ("Configure", {"options": {"depth": 3, "tags": ["a", "b"], "inner": {"x": None, "y": [1, 2.5]}}}),
    ("Configure", {"options": {}}),
    ("Configure", {"ratio": 0.25, "note": "x<y"}),
    ("Configure", {"note": "line one\n\nline three\n"}),
    ("Configure", {"options": {"cmd": "a </parameter> b"}}),
    ("Configure", {}),
    ("Bash", {"command": "python -c \"print({'a': [1, 2]})\"", "timeout": 5}),
]


def _written(tokenizer, name: str, args: dict[str, Any]) -> str:  # noqa: ANN001
    """The call as the model writes it: the template's own rendering of it in an assistant turn."""
    msgs = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]}]
    text = render_prompt(tokenizer, msgs, TOOLS, add_generation_prompt=False, tool_parser="qwen3_coder")
    start = text.index("<tool_call>", text.rindex("<|im_start|>assistant"))
    return text[start:text.rindex("<|im_end|>")]


def test_twenty_xml_tool_calls_parse_to_their_arguments(tokenizer) -> None:  # noqa: ANN001
    assert len(CALLS) == 20 and detect_tool_parser(TEMPLATE) == "qwen3_coder"
    parser = get_tool_parser(find_profile("Qwen3.8-27B").tool_parser, TOOLS)
    for name, args in CALLS:
        written = _written(tokenizer, name, args)
        assert written.startswith(f"<tool_call>\n<function={name}>\n")
        out = parser.parse("Let me look.\n\n" + written)
        assert out.content.strip() == "Let me look."
        assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [(name, args)], written
        # Streamed in pieces of 7 characters, the same calls come out.
        stream, calls = parser.stream(), {}
        pieces = [written[i:i + 7] for i in range(0, len(written), 7)]
        for d in [d for piece in pieces for d in stream.feed(piece)] + stream.finish():
            if d.tool_call is not None:
                calls.setdefault(d.tool_call.index, [d.tool_call.name or "", ""])[1] += d.tool_call.arguments
        assert [(n, json.loads(a)) for n, a in calls.values()] == [(name, args)], written


def test_the_server_renders_at_medium_unless_the_client_names_an_effort(tokenizer) -> None:  # noqa: ANN001
    from agentbox.config import ServerConfig
    from agentbox.server.app import model_defaults
    from agentbox.server.chat_pipeline import Conversation, fold, prepare_chat
    from agentbox.server.state import ServerState

    d = model_defaults("/models/Qwen3.8-27B-UD-Q4_K_M.gguf", "Qwen3.8-27B")
    assert d.reasoning_effort is ReasoningEffort.MEDIUM and d.tool_parser == "qwen3_coder"
    state = ServerState(ServerConfig(), None, tokenizer, None, "Qwen3.8-27B",  # type: ignore[arg-type]
                        tool_parser=d.tool_parser, default_effort=d.reasoning_effort)
    msgs = claude_code_request()
    plain = prepare_chat(state, Conversation(msgs, TOOLS), check_length=False).prompt_text
    assert XHIGH_TEXT not in plain and LOW_TEXT not in plain
    asked = prepare_chat(state, Conversation(msgs, TOOLS, reasoning_effort=ReasoningEffort.HIGH),
                         check_length=False).prompt_text
    assert asked.startswith("<|im_start|>system\n" + XHIGH_TEXT)
    low = prepare_chat(state, Conversation(msgs, TOOLS, reasoning_effort=ReasoningEffort.LOW), check_length=False)
    assert LOW_TEXT in low.prompt_text and low.tool_parser == "qwen3_coder"
    # What the model writes after the prompt's `<think>\n`: reasoning, text, an XML call with a `<` in a value.
    written = "The test expects 4; f adds one too many.\n</think>\n\nFixing f.\n\n" + _written(tokenizer, *CALLS[6])
    proc = low.output()
    assert low.reasoning_style == "qwen3" and low.starts_inside
    out = fold([d for i in range(0, len(written), 5) for d in proc.feed(written[i:i + 5])] + proc.finish())
    assert out.reasoning.strip() == "The test expects 4; f adds one too many."
    assert out.content.strip() == "Fixing f."
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [CALLS[6]]
    grammar = low.grammar()
    assert grammar is not None and grammar.syntax is not None and grammar.syntax.prefix == "<tool_call>\n<function="


def test_the_call_grammar_accepts_the_twenty_calls(tokenizer) -> None:  # noqa: ANN001
    """Constrained decoding lets through every call the template itself writes: parameters in the schema's
    order (a grammar built from a key-sorted schema refused `old_string` after `file_path`), values with `<`."""
    from agentbox.chat.grammar import grammar_spec
    from agentbox.engine.grammar import GrammarCompiler

    compiler = GrammarCompiler(tokenizer, len(tokenizer))
    for name, args in CALLS:
        written = _written(tokenizer, name, args)
        state = compiler.state(grammar_spec(TOOLS, {"type": "function", "function": {"name": name}}, None,
                                            "qwen3_coder"))
        ids = tokenizer.encode(written, add_special_tokens=False)
        assert all(state.accept(i) for i in ids), written
        assert state.accept(tokenizer.eos_token_id) and state.is_terminated(), written
