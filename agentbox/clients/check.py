"""`agentbox check tools`: prove against a running server that tool calls round-trip through the official
openai client the way an agent uses them. Each check is a real request; a failure says what came back.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

LIST_FILES = {"type": "function", "function": {
    "name": "list_files", "description": "List the files in the working directory.",
    "parameters": {"type": "object", "properties": {}}}}
# maxLength 32: the longest bound the grammar enforces (engine/grammar.py MAX_STRING_BOUND), so a small model's
# forced path ends there
READ_FILE = {"type": "function", "function": {
    "name": "read_file", "description": "Read one file.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string", "maxLength": 32}}, "required": ["path"]}}}
TOOLS = [LIST_FILES, READ_FILE]
THINK_TAGS = ("<think>", "</think>")


@dataclass
class CheckResult:
    name: str
    ok: bool
    detail: str


class CheckFailed(Exception):
    pass


def _force(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def _args(name: str, arguments: str) -> dict:
    """A call's arguments as a dict holding its tool's required keys, or CheckFailed saying why not."""
    try:
        args = json.loads(arguments)
    except ValueError as e:
        raise CheckFailed(f"{name}: arguments are not JSON: {arguments!r:.80}") from e
    if not isinstance(args, dict):
        raise CheckFailed(f"{name}: arguments are not an object: {args!r:.80}")
    spec = next((t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name), None)
    if spec is None:
        raise CheckFailed(f"called {name!r}, which is not among the tools")
    missing = [k for k in spec.get("required", []) if k not in args]
    if missing:
        raise CheckFailed(f"{name}: missing required {missing} in {args}")
    return args


def _as_assistant(calls: list[Any]) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
        for c in calls]}


def _results(calls: list[Any]) -> list[dict]:
    return [{"role": "tool", "tool_call_id": c.id,
             "content": "README.md\nsetup.py" if c.function.name == "list_files" else "print('hello')"} for c in calls]


class Checker:
    def __init__(self, url: str, model: str | None = None, api_key: str = "agentbox", timeout: float = 300.0) -> None:
        import openai

        self.client = openai.OpenAI(base_url=url.rstrip("/") + "/v1", api_key=api_key, max_retries=0, timeout=timeout)
        self.model = model or self.client.models.list().data[0].id
        self.base = [{"role": "system", "content": "You are a coding agent. Use the tools."},
                     {"role": "user", "content": "Look at the project files and read setup.py."}]

    def call(self, messages: list[dict], choice: Any, max_tokens: int = 256, **kw: Any) -> tuple[list[Any], str]:
        r = self.client.chat.completions.create(model=self.model, messages=messages, tools=TOOLS, tool_choice=choice,
                                                max_tokens=max_tokens, temperature=0, **kw)
        ch = r.choices[0]
        calls = list(ch.message.tool_calls or [])
        if not calls:
            raise CheckFailed(f"no tool call came back (finish_reason {ch.finish_reason}, content {ch.message.content!r:.60})")
        if ch.finish_reason != "tool_calls":
            raise CheckFailed(f"finish_reason is {ch.finish_reason!r}, not 'tool_calls'")
        return calls, ch.finish_reason

    # ---- the checks ------------------------------------------------------------------------------
    def zero_argument_call(self) -> str:
        calls, _ = self.call(self.base, _force("list_files"))
        if calls[0].function.name != "list_files":
            raise CheckFailed(f"forced list_files, got {calls[0].function.name}")
        args = _args("list_files", calls[0].function.arguments)
        if args != {}:
            raise CheckFailed(f"a zero-argument call parsed to {args}, not {{}}")
        return f"list_files() -> {calls[0].function.arguments}"

    def reasoning_apart(self) -> str:
        stream = self.client.chat.completions.create(
            model=self.model, messages=[{"role": "user", "content": "Think step by step: what is 2 + 3?"}],
            max_tokens=128, temperature=0, stream=True)
        content, reasoning = "", ""
        for chunk in stream:
            if not chunk.choices:
                continue
            d = chunk.choices[0].delta
            content += d.content or ""
            extra = d.model_extra or {}
            reasoning += extra.get("reasoning_content") or extra.get("reasoning") or ""
        leaked = [t for t in THINK_TAGS if t in content]
        if leaked:
            raise CheckFailed(f"reasoning markup {leaked} reached content: {content!r:.80}")
        if reasoning and reasoning.strip() in content:
            raise CheckFailed("the reasoning text was repeated in content")
        return f"{len(reasoning)} reasoning chars, {len(content)} content chars, no markup in content"

    def streamed_required_call(self) -> str:
        stream = self.client.chat.completions.create(
            model=self.model, messages=self.base, tools=TOOLS, tool_choice="required", max_tokens=256, temperature=0,
            stream=True)
        calls: dict[int, dict] = {}
        finish = None
        for chunk in stream:
            if not chunk.choices:
                continue
            ch = chunk.choices[0]
            finish = ch.finish_reason or finish
            for tc in ch.delta.tool_calls or []:
                slot = calls.get(tc.index)
                if slot is None:
                    if not (tc.id and tc.function and tc.function.name):
                        raise CheckFailed(f"call {tc.index}'s first delta lacks its id or name")
                    slot = calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
                elif tc.id and tc.id != slot["id"]:
                    raise CheckFailed(f"call {tc.index} changed id mid-stream")
                slot["arguments"] += (tc.function.arguments or "") if tc.function else ""
        if not calls or sorted(calls) != list(range(len(calls))):
            raise CheckFailed(f"call indices {sorted(calls)} are not 0..n-1")
        for c in calls.values():
            _args(c["name"], c["arguments"])
        if finish != "tool_calls":
            raise CheckFailed(f"finish_reason is {finish!r}, not 'tool_calls'")
        return ", ".join(f"{c['name']}{c['arguments']}" for c in calls.values())

    def multi_turn_sequence(self) -> str:
        msgs = list(self.base)
        trail = []
        for name in ("list_files", "read_file", "list_files"):
            calls, _ = self.call(msgs, _force(name))
            if calls[0].function.name != name:
                raise CheckFailed(f"turn {len(trail) + 1}: forced {name}, got {calls[0].function.name}")
            _args(name, calls[0].function.arguments)
            trail.append(f"{name}{calls[0].function.arguments}")
            msgs += [_as_assistant(calls), *_results(calls)]
        return " -> ".join(trail)

    def parallel_round_trip(self) -> str:
        a, _ = self.call(self.base, _force("list_files"))
        b, _ = self.call(self.base, _force("read_file"))
        both = [a[0], b[0]]  # two calls answered in one assistant turn, results fed back in order
        msgs = [*self.base, _as_assistant(both), *_results(both)]
        calls, _ = self.call(msgs, "required", parallel_tool_calls=True)
        for c in calls:
            _args(c.function.name, c.function.arguments)
        ids = [c.id for c in calls]
        if len(set(ids)) != len(ids):
            raise CheckFailed(f"parallel calls share ids: {ids}")
        return f"2 calls fed back; next turn: {len(calls)} call(s) " + ", ".join(c.function.name for c in calls)


CHECKS: list[tuple[str, Callable[[Checker], str]]] = [
    ("zero-argument call parses to {}", Checker.zero_argument_call),
    ("reasoning never reaches content", Checker.reasoning_apart),
    ("streamed required call (index, id+name, arguments)", Checker.streamed_required_call),
    ("three forced calls across turns with results", Checker.multi_turn_sequence),
    ("parallel calls fed back, next call parses", Checker.parallel_round_trip),
]


def run_checks(url: str, model: str | None = None, api_key: str = "agentbox") -> list[CheckResult]:
    """Every check against the server at `url` (its root, no /v1); a broken server fails every check."""
    import openai

    try:
        checker = Checker(url, model, api_key)
    except openai.OpenAIError as e:
        return [CheckResult("server reachable", False, str(e))]
    results = []
    for name, fn in CHECKS:
        try:
            results.append(CheckResult(name, True, fn(checker)))
        except CheckFailed as e:
            results.append(CheckResult(name, False, str(e)))
        except openai.OpenAIError as e:
            results.append(CheckResult(name, False, f"{type(e).__name__}: {e}"))
    return results
