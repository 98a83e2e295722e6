"""A seeded synthetic coding-agent trace, calibrated to published agent traffic.

Calibration (docs/bench.md has the sources): a shared system prompt + tool definitions of a few thousand
tokens; a median of about 60 turns per session; tool results heavy-tailed (most are a few hundred tokens,
a few are whole files); histories growing to tens of thousands of tokens; tool gaps log-normal with a
median near 0.42 s, 86 % under 1 s and 95 % under 10 s. Every size has a scale knob so a CPU run on a
small model finishes in minutes. Text is plausible token-ish content: words from a fixed vocabulary and
code-like lines, deterministic per seed (session i is the same whatever the number of sessions).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass

from agentbox.trace import Message, Prefix, Session, Turn, estimate_tokens

# Tool gaps: a mixture of two log-normals. 90 % quick tools (median 0.38 s, sigma 0.6) and 10 % slow ones
# (median 8 s, sigma 1.3, test suites and builds) gives median ~0.42 s, P(<1 s) ~0.86, P(<10 s) ~0.95.
WAIT_FAST_MEDIAN_S = 0.38
WAIT_FAST_SIGMA = 0.6
WAIT_SLOW_SHARE = 0.10
WAIT_SLOW_MEDIAN_S = 8.0
WAIT_SLOW_SIGMA = 1.3
WAIT_MAX_S = 300.0


@dataclass(frozen=True)
class SynthConfig:
    sessions: int = 24
    turns: int = 60  # median turns per session
    turn_sigma: float = 0.5  # log-normal spread of turn counts; 0: every session has exactly `turns`
    prefix_tokens: int = 3000  # system prompt + tool definitions
    task_tokens: int = 250  # the user's task message
    result_tokens_median: int = 150  # tool result sizes: log-normal, heavy tail, capped
    result_sigma: float = 1.2
    result_tokens_max: int = 8000
    output_tokens_median: int = 90  # assistant answers (reasoning + one tool call)
    output_sigma: float = 0.6
    output_tokens_max: int = 1024
    scale: float = 1.0  # multiplies every token size above (prefix, task, results, outputs)
    result_scale: float = 1.0  # multiplies tool results on top of `scale`
    wait: str | float = "lognormal"  # "lognormal" (calibrated gaps) or fixed seconds (0.5, 5, 60)
    max_context_tokens: int | None = None  # a session ends before its history would pass this
    seed: int = 0


def sample_wait(rng: random.Random) -> float:
    """One tool gap from the calibrated mixture."""
    if rng.random() < WAIT_SLOW_SHARE:
        w = WAIT_SLOW_MEDIAN_S * math.exp(rng.gauss(0.0, WAIT_SLOW_SIGMA))
    else:
        w = WAIT_FAST_MEDIAN_S * math.exp(rng.gauss(0.0, WAIT_FAST_SIGMA))
    return round(min(w, WAIT_MAX_S), 3)


def generate(cfg: SynthConfig) -> list[Session]:
    if cfg.sessions < 1 or cfg.turns < 1:
        raise ValueError("sessions and turns must be at least 1")
    if cfg.wait != "lognormal" and not isinstance(cfg.wait, (int, float)):
        raise ValueError(f"wait must be 'lognormal' or seconds, got {cfg.wait!r}")
    prefix = make_prefix(cfg)
    return [_session(cfg, prefix, i) for i in range(cfg.sessions)]


def make_prefix(cfg: SynthConfig) -> Prefix:
    rng = random.Random(f"{cfg.seed}:prefix")
    tools = [dict(t) for t in TOOLS]
    tools_tokens = estimate_tokens(json.dumps(tools))
    target = max(64, round(cfg.prefix_tokens * cfg.scale) - tools_tokens)
    system = (
        "You are a coding agent working in a software repository. Use the tools to inspect files, run "
        "commands and edit code until the task is done, then call finish.\n\n" + _prose(rng, target)
    )
    return Prefix(messages=[{"role": "system", "content": system}], tools=tools)


def _session(cfg: SynthConfig, prefix: Prefix, index: int) -> Session:
    rng = random.Random(f"{cfg.seed}:session:{index}")
    n_turns = cfg.turns
    if cfg.turn_sigma > 0:
        n_turns = round(cfg.turns * math.exp(rng.gauss(0.0, cfg.turn_sigma)))
        n_turns = min(max(n_turns, 2), 4 * cfg.turns)
    history = estimate_tokens(prefix.messages[0]["content"]) + estimate_tokens(json.dumps(prefix.tools))
    pending: list[Message] = [{"role": "user", "content": _task(rng, _scaled(cfg.task_tokens, cfg.scale))}]
    turns: list[Turn] = []
    for t in range(n_turns):
        out_tokens = _lognormal_tokens(
            rng, cfg.output_tokens_median * cfg.scale, cfg.output_sigma, cfg.output_tokens_max
        )
        added = sum(estimate_tokens(m["content"]) for m in pending) + out_tokens
        if cfg.max_context_tokens is not None and turns and history + added > cfg.max_context_tokens:
            break
        history += added
        last = t == n_turns - 1
        tool = "finish" if last else rng.choice(_WORK_TOOLS)
        call_id = f"call_{index}_{t}"
        args = _tool_args(rng, tool)
        text = _prose(rng, max(4, out_tokens - estimate_tokens(json.dumps(args)) - 8))
        wait = 0.0 if last else (sample_wait(rng) if cfg.wait == "lognormal" else float(cfg.wait))
        turns.append(
            Turn(
                messages=pending,
                output=text,
                output_tokens=out_tokens,
                wait_s=wait,
                tool_calls=[
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": tool, "arguments": json.dumps(args)},
                    }
                ],
            )
        )
        size = _lognormal_tokens(
            rng,
            cfg.result_tokens_median * cfg.scale * cfg.result_scale,
            cfg.result_sigma,
            round(cfg.result_tokens_max * cfg.scale * cfg.result_scale),
        )
        pending = [
            {
                "role": "tool",
                "tool_call_id": call_id,
                "name": tool,
                "content": _tool_result(rng, tool, args, size),
            }
        ]
    return Session(id=f"synth-{cfg.seed}-{index}", prefix=prefix, turns=turns)


def _scaled(tokens: int, scale: float) -> int:
    return max(1, round(tokens * scale))


def _lognormal_tokens(rng: random.Random, median: float, sigma: float, cap: int) -> int:
    return int(min(max(1, round(median * math.exp(rng.gauss(0.0, sigma)))), max(1, cap)))


# ---- text ----

WORDS = (
    "the a to of and in is for that this it with on as be by from value file test error function return "
    "call line module config cache request session token model server client path result check update "
    "fix change add remove handle case when then before after because missing expected actual output "
    "input parse build run step state index key list dict string number count size length first last "
    "next previous current new old default option flag should would could must need use make keep read "
    "write open close start stop load save import class method field type name data item node page block"
).split()
IDENTS = (
    "cache self config request session tokens model server client path result state index key items "
    "node page block parser handler manager loader writer reader buffer offset length count value "
    "options params args kwargs response payload schema record entry"
).split()
DIRS = ("src", "lib", "tests", "core", "utils", "api", "models", "io")


def _ident(rng: random.Random) -> str:
    return "_".join(rng.choice(IDENTS) for _ in range(rng.randint(1, 2)))


def _path(rng: random.Random) -> str:
    return f"{rng.choice(DIRS)}/{_ident(rng)}.py"


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(6, 16))]
    return " ".join(words).capitalize() + "."


def _prose(rng: random.Random, tokens: int) -> str:
    """About `tokens` tokens of sentences, in short paragraphs."""
    out: list[str] = []
    size = 0
    while size < tokens * 4:  # characters, at CHARS_PER_TOKEN
        s = _sentence(rng) + ("\n\n" if rng.random() < 0.15 else " ")
        out.append(s)
        size += len(s)
    return "".join(out).strip()


def _code_line(rng: random.Random) -> str:
    a, b, c = _ident(rng), _ident(rng), _ident(rng)
    kind = rng.randrange(11)  # pick the shape first: building every shape per line was the hot spot
    if kind == 0:
        return f"def {a}({b}, {c}=None):"
    if kind == 1:
        return f"    {a} = self.{b}.get({c})"
    if kind == 2:
        return f"    return {a}"
    if kind == 3:
        return f"    if {a} is None:"
    if kind == 4:
        return f'        raise ValueError("{rng.choice(WORDS)} {rng.choice(WORDS)} {a}")'
    if kind == 5:
        return f"    for {a} in {b}:"
    if kind == 6:
        return f"        {a}[{b}] = {c} + {rng.randint(1, 64)}"
    if kind == 7:
        return f"class {a.title().replace('_', '')}:"
    if kind == 8:
        return f"from {rng.choice(DIRS)}.{a} import {b}"
    if kind == 9:
        return f"    # {_sentence(rng)}"
    return ""


def _lines(rng: random.Random, tokens: int, make: object) -> str:
    out: list[str] = []
    size = 0
    while size < tokens * 4:
        line = make(rng)  # type: ignore[operator]
        out.append(line)
        size += len(line) + 1
    return "\n".join(out)


def _task(rng: random.Random, tokens: int) -> str:
    return (
        f"<issue>\nThe function in {_path(rng)} fails when {rng.choice(IDENTS)} is empty.\n"
        + _prose(rng, max(8, tokens - 24))
        + "\n</issue>\nFix the issue so that the tests pass."
    )


def _tool_args(rng: random.Random, tool: str) -> dict[str, object]:
    if tool == "execute_bash":
        return {
            "command": rng.choice(
                (
                    f"python -m pytest tests/test_{_ident(rng)}.py -x -q",
                    f"grep -rn {_ident(rng)} src/",
                    f"ls -la {rng.choice(DIRS)}",
                    f"git diff {_path(rng)}",
                )
            )
        }
    if tool == "str_replace_editor":
        cmd = rng.choice(("view", "view", "str_replace"))
        args: dict[str, object] = {"command": cmd, "path": f"/workspace/{_path(rng)}"}
        if cmd == "str_replace":
            args |= {"old_str": _code_line(rng), "new_str": _code_line(rng)}
        return args
    if tool == "think":
        return {"thought": _sentence(rng)}
    return {"message": "The issue is fixed and the tests pass."}


def _tool_result(rng: random.Random, tool: str, args: dict[str, object], tokens: int) -> str:
    if tool == "str_replace_editor":
        n = rng.randint(1, 400)
        body = _lines(rng, tokens, _code_line).split("\n")
        return f"Here's the result of running `cat -n` on {args['path']}:\n" + "\n".join(
            f"{n + i:6d}\t{line}" for i, line in enumerate(body)
        )
    if tool == "execute_bash":

        def out_line(r: random.Random) -> str:
            kind = r.randrange(5)
            if kind == 0:
                return f"{_path(r)}:{r.randint(1, 900)}: {_code_line(r).strip()}"
            if kind == 1:
                return f"FAILED tests/test_{_ident(r)}.py::test_{_ident(r)} - AssertionError: {_sentence(r)}"
            if kind == 2:
                return f"tests/test_{_ident(r)}.py ....F..  [{r.randint(1, 100)}%]"
            if kind == 3:
                return f"-rw-r--r-- 1 root root {r.randint(100, 99999):6d} {_path(r)}"
            return f"E       assert {_ident(r)} == {r.randint(0, 9)}"

        return _lines(rng, tokens, out_line) + "\n[The command completed with exit code 1.]"
    return _prose(rng, tokens) if tool == "think" else "Task finished."


def _fn(name: str, description: str, props: dict[str, dict[str, object]], required: list[str]) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": props, "required": required},
        },
    }


# OpenHands-style tool definitions: the fixed part of the shared prefix.
TOOLS = (
    _fn(
        "execute_bash",
        "Execute a bash command in the terminal. Long running commands should be run in the background. "
        "The command output is truncated when it is too long. One command at a time.",
        {
            "command": {"type": "string", "description": "The bash command to execute."},
            "is_input": {
                "type": "string",
                "enum": ["true", "false"],
                "description": "Whether the command is input to a running process.",
            },
        },
        ["command"],
    ),
    _fn(
        "str_replace_editor",
        "Custom editing tool for viewing, creating and editing files. State is persistent across calls. "
        "`view` shows a file with line numbers or lists a directory; `create` writes a new file; "
        "`str_replace` replaces exactly one occurrence of old_str with new_str; `insert` adds text after "
        "a line; `undo_edit` reverts the last edit of a file.",
        {
            "command": {"type": "string", "enum": ["view", "create", "str_replace", "insert", "undo_edit"]},
            "path": {"type": "string", "description": "Absolute path to a file or directory."},
            "old_str": {"type": "string", "description": "The text to replace; must match exactly once."},
            "new_str": {"type": "string", "description": "The replacement text."},
            "insert_line": {"type": "integer", "description": "Insert after this line."},
            "view_range": {"type": "array", "items": {"type": "integer"}},
        },
        ["command", "path"],
    ),
    _fn(
        "think",
        "Think about the problem without changing anything. Use it to plan or to reason about "
        "what a tool output means.",
        {"thought": {"type": "string"}},
        ["thought"],
    ),
    _fn("finish", "Signal that the task is complete.", {"message": {"type": "string"}}, ["message"]),
)
_WORK_TOOLS = ("execute_bash", "str_replace_editor", "str_replace_editor", "execute_bash", "think")
