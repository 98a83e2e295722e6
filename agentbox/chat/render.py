"""Render a conversation to prompt text with the model's own chat template, the same way every turn.

Prompt stability is part of caching: whatever varies per request but not per conversation (Claude
Code's billing-header block) is stripped, and every normalisation here is a pure function of the
messages, so turn N+1's prompt starts with turn N's prompt plus its answer.
"""

from __future__ import annotations

import json
from typing import Any

from agentbox.chat import harmony
from agentbox.chat.effort import ReasoningEffort, fit_to_template
from agentbox.chat.template import template_text
from agentbox.chat.template_traits import late_system_as_user, open_with_user_query, traits_of
from agentbox.chat.tool_prompt import fold_tools_into_messages, template_renders_tools

BILLING_HEADER = "x-anthropic-billing-header:"
TEXT_PART_TYPES = ("text", "input_text", "output_text")


def normalize_content(content: Any) -> str:
    """OpenAI message content (a string, None, or a list of text parts) as one string."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type", "text") in TEXT_PART_TYPES:
                texts.append(str(part.get("text", "")))
            else:
                raise ValueError(f"unsupported content part: {part!r:.80}")
        return "\n".join(texts)
    raise ValueError(f"unsupported message content of type {type(content).__name__}")


def is_billing_header(text: str) -> bool:
    return text.lstrip().lower().startswith(BILLING_HEADER)


def strip_billing_header(content: Any) -> Any:
    """Drop Claude Code's per-request `x-anthropic-billing-header: …` text (a block or a first line)."""
    if isinstance(content, list):
        return [p for p in content if not (isinstance(p, dict) and is_billing_header(str(p.get("text", ""))))]
    if isinstance(content, str) and is_billing_header(content):
        _, _, rest = content.lstrip().partition("\n")
        return rest.lstrip("\n")
    return content


def normalize_tools(tools: list[dict] | None) -> list[dict] | None:
    """Tools in the OpenAI `{"type": "function", "function": {...}}` shape the templates expect; a tool
    without a name (or not an object) is a ValueError naming it: the model could never call it."""
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise ValueError(f"tools[{i}] is not an object")
        if t.get("type") == "function" and "function" in t:
            fn, where = t["function"], f"tools[{i}].function"
        else:  # a bare function, or Anthropic's {name, description, input_schema}
            fn = {"name": t.get("name"), "description": t.get("description", "")}
            fn["parameters"] = t.get("parameters") or t.get("input_schema") or {"type": "object", "properties": {}}
            t, where = {"type": "function", "function": fn}, f"tools[{i}]"
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"{where}.name is missing: every tool needs a name the model can call it by")
        if not isinstance(fn.get("parameters", {}), dict):
            raise ValueError(f"{where}.parameters must be a JSON schema object")
        out.append(t)
    return out


def template_takes_string_arguments(template: str) -> bool:
    """Templates that test `arguments is string` print a string as is; all others need a dict."""
    return "arguments is string" in template or "arguments is mapping" in template


def prepare_messages(messages: list[dict], template: str) -> list[dict]:
    """The per-message normalisation (pure: same input, same output)."""
    keep_strings = template_takes_string_arguments(template)
    out: list[dict] = []
    for m in messages:
        # A shallow copy: every nested value this changes is rebuilt below, never edited in place, and a deep
        # copy of a 128k-token conversation took a third of its render time.
        m = dict(m)
        role = m.get("role")
        if role in ("system", "developer"):
            m["role"] = "system"
            m["content"] = normalize_content(strip_billing_header(m.get("content")))
            if not m["content"].strip():
                continue
        else:
            m["content"] = normalize_content(m.get("content"))
        if role == "assistant":
            reasoning = m.pop("reasoning_content", None) or m.pop("reasoning", None)
            m.pop("reasoning", None)
            if reasoning:
                # Templates read one name or the other; both carry the same text.
                m["reasoning_content"] = m["reasoning"] = reasoning
            calls = []
            for call in m.get("tool_calls") or []:
                fn = dict(call.get("function", call))
                args = fn.get("arguments")
                if isinstance(args, str) and not keep_strings:
                    try:
                        fn["arguments"] = json.loads(args) if args.strip() else {}
                    except ValueError:
                        pass  # leave malformed arguments as sent rather than refuse the turn
                elif args is None:
                    fn["arguments"] = "{}" if keep_strings else {}
                calls.append({**call, "type": "function", "function": fn})
            if calls:
                m["tool_calls"] = calls
        out.append(m)
    return out


def merge_leading_system_messages(messages: list[dict]) -> list[dict]:
    """The system messages before the first other message folded into one, in order, for templates that accept a
    system message only first. Later ones stay where they are (template_traits.py says why)."""
    first = next((i for i, m in enumerate(messages) if m.get("role") != "system"), len(messages))
    if first <= 1:
        return messages
    return [{"role": "system", "content": "\n\n".join(m["content"] for m in messages[:first])}, *messages[first:]]


def render_prompt(
    tokenizer: Any,
    messages: list[dict],
    tools: list[dict] | None = None,
    *,
    add_generation_prompt: bool = True,
    enable_thinking: bool | None = None,
    reasoning_effort: ReasoningEffort | None = None,
    tool_parser: str = "hermes",
) -> str:
    """The prompt text for `messages` (+ `tools`) under the tokenizer's chat template. A template that
    prints no tools gets them in the system turn, in `tool_parser`'s call syntax (chat/tool_prompt.py).
    `reasoning_effort` reaches templates that read a `reasoning_effort` variable (gpt-oss: as its level)."""
    tools_n = normalize_tools(tools)
    template = template_text(tokenizer, tools=bool(tools_n))
    prepared = prepare_messages(messages, template)
    if harmony.is_harmony_template(template):
        prepared, tools_n = harmony.prepare_messages(prepared), harmony.prepare_tools(tools_n)
    elif tools_n and not template_renders_tools(tokenizer, template):
        prepared, tools_n = fold_tools_into_messages(prepared, tools_n, tool_parser), None
    kwargs: dict[str, Any] = {}
    if enable_thinking is not None:
        kwargs["enable_thinking"] = enable_thinking
    if "preserve_thinking" in template:
        # Qwen3.5 / 3.6 drop earlier turns' reasoning unless told to keep it: kept, turn N+1 starts with the
        # very tokens turn N ended with, so the session's cache and its recurrent-state snapshot stay usable.
        kwargs["preserve_thinking"] = True
    if "drop_thinking" in template:
        # DeepSeek-V4 drops the reasoning of turns before the last user message (in a chat without tools) unless
        # told not to: kept, for the same reason as preserve_thinking.
        kwargs["drop_thinking"] = False
    if reasoning_effort is not None and "reasoning_effort" in template:
        is_harmony = harmony.is_harmony_template(template)
        kwargs["reasoning_effort"] = (harmony.template_effort(reasoning_effort) if is_harmony
                                      else fit_to_template(reasoning_effort, template).value)

    def apply(msgs: list[dict]) -> str:
        text = tokenizer.apply_chat_template(
            msgs, tools=tools_n, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )
        return text if isinstance(text, str) else str(text)

    def probe(msgs: list[dict]) -> str:  # the template alone: no tools, no options that could raise by themselves
        return str(tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))

    traits = traits_of(template, probe)
    if traits.rejects_late_system:
        prepared = late_system_as_user(merge_leading_system_messages(prepared))
    if traits.needs_user_query:
        prepared = open_with_user_query(prepared)
    return apply(prepared)
