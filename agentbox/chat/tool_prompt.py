"""Tools for templates that have no tools section (SmolLM2's, many base-model templates).

Such a template drops `tools=` without a word, so the model never sees a tool. The fallback writes the
tool definitions and the call format into the system turn, in the syntax of the tool parser that will
read the answer (the same syntax the grammar constrains calls to), and re-renders earlier calls and tool
results as text in that syntax, so turn N+1's prompt starts with turn N's prompt plus what the model wrote.
"""

from __future__ import annotations

import json
from typing import Any

PROBE_TOOL = "agentbox_probe_tool_7f3a"
_renders: dict[tuple[int, str], bool] = {}


def template_renders_tools(tokenizer: Any, template: str) -> bool:
    """Whether the template prints the tools it is given (probed once per tokenizer and template)."""
    key = (id(tokenizer), template)
    if key not in _renders:
        probe = [{"type": "function", "function": {"name": PROBE_TOOL, "description": "",
                                                   "parameters": {"type": "object", "properties": {}}}}]
        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=probe, tokenize=False,
                                                 add_generation_prompt=True)
        except Exception:  # a template that rejects the probe still cannot be trusted to print tools
            text = ""
        _renders[key] = PROBE_TOOL in str(text)
    return _renders[key]


def _args_dict(arguments: Any) -> dict:
    if isinstance(arguments, dict):
        return arguments
    if isinstance(arguments, str) and arguments.strip():
        try:
            value = json.loads(arguments)
        except ValueError:
            return {}
        return value if isinstance(value, dict) else {}
    return {}


def _scalar(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)


def call_text(name: str, arguments: Any, parser: str) -> str:
    """One call exactly as the parser reads it (and as the grammar lets the model write it)."""
    args = _args_dict(arguments)
    if parser == "qwen3_coder":
        params = "".join(f"<parameter={k}>\n{_scalar(v)}\n</parameter>\n" for k, v in args.items())
        return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"
    if parser == "glm45":
        pairs = "".join(f"<arg_key>{k}</arg_key><arg_value>{_scalar(v)}</arg_value>" for k, v in args.items())
        return f"<tool_call>{name}{pairs}</tool_call>"
    body = json.dumps(args, ensure_ascii=False)
    if parser == "llama3_json":
        return f'<|python_tag|>{{"name": "{name}", "parameters": {body}}}'
    if parser == "mistral":
        return f"[TOOL_CALLS]{name}[ARGS]{body}"
    return f'<tool_call>\n{{"name": "{name}", "arguments": {body}}}\n</tool_call>'


def tools_system_text(tools: list[dict], parser: str) -> str:
    """The tools section for the system turn: signatures, then the call format with an example."""
    sigs = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    example = call_text("<function-name>", {"<argument-name>": "<value>"}, parser)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{sigs}\n</tools>\n\n"
        f"To call a function, write the call in exactly this format:\n{example}"
    )


def fold_tools_into_messages(messages: list[dict], tools: list[dict], parser: str) -> list[dict]:
    """The conversation with the tools in the system turn, calls as text, results as user turns."""
    section = tools_system_text(tools, parser)
    out: list[dict] = []
    for m in messages:
        role = m.get("role")
        if role == "assistant" and m.get("tool_calls"):
            calls = [call_text(c["function"]["name"], c["function"].get("arguments"), parser) for c in m["tool_calls"]]
            text = "\n".join(x for x in (m.get("content") or "", *calls) if x)
            m = {k: v for k, v in m.items() if k != "tool_calls"} | {"content": text}
        elif role == "tool":
            result = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("role") == "user" and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + result
                continue
            m = {"role": "user", "content": result, "_tool_results": True}
        out.append(m)
    for m in out:
        m.pop("_tool_results", None)
    if out and out[0].get("role") == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{section}" if out[0]["content"] else section}
    else:
        out.insert(0, {"role": "system", "content": section})
    return out
