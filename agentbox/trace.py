"""The replay trace: one agent session per JSONL line (format documented in docs/bench.md). Written by
`serve --record-trace` (server/trace_recorder.py), read by the benchmarks (bench/): a leaf module that
imports nothing of agentbox, so the server need not import bench/.

A session is a shared prefix (system messages + tool definitions, byte-identical across the sessions of a
trace, as it is across a real agent's tasks) and a list of turns. A turn appends some messages (the user
task, or the tool results of the previous call), then the model answers; the recorded answer is what the
replayer appends afterwards, never the model's own, so every engine sees identical prompts.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

Message = dict[str, Any]

# Tokens per character of plain text and code under a BPE tokenizer: an estimate only, used to size
# synthetic text and to fill missing counts; metrics use the token counts the server reports.
CHARS_PER_TOKEN = 4.0


def estimate_tokens(text: str) -> int:
    return max(1, round(len(text) / CHARS_PER_TOKEN)) if text else 0


@dataclass
class Prefix:
    """What every request of every session starts with: system messages and tool definitions."""

    messages: list[Message]
    tools: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Turn:
    messages: list[Message]  # appended before this turn's request (user task or tool results)
    output: str  # the recorded assistant text
    output_tokens: int  # the recorded length of the answer; the replayer asks for exactly this many
    wait_s: float = 0.0  # tool time after the answer, before the next turn's request
    tool_calls: list[dict[str, Any]] | None = None  # the recorded assistant's tool calls (OpenAI form)

    def assistant_message(self) -> Message:
        # content stays a string even with tool calls: some chat templates concatenate it unconditionally.
        msg: Message = {"role": "assistant", "content": self.output}
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        return msg


@dataclass
class Session:
    id: str
    prefix: Prefix
    turns: list[Turn]

    def prompts(self) -> Iterable[list[Message]]:
        """The messages of each turn's request, in order (the conversation so far)."""
        conv = list(self.prefix.messages)
        for turn in self.turns:
            conv.extend(turn.messages)
            yield list(conv)
            conv.append(turn.assistant_message())

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "prefix": {"messages": self.prefix.messages, "tools": self.prefix.tools},
            "turns": [
                {
                    "messages": t.messages,
                    "output": t.output,
                    "output_tokens": t.output_tokens,
                    "wait_s": t.wait_s,
                    **({"tool_calls": t.tool_calls} if t.tool_calls else {}),
                }
                for t in self.turns
            ],
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Session:
        try:
            prefix = Prefix(list(obj["prefix"]["messages"]), list(obj["prefix"].get("tools") or []))
            turns = [
                Turn(
                    messages=list(t["messages"]),
                    output=str(t["output"]),
                    output_tokens=int(t["output_tokens"]),
                    wait_s=float(t.get("wait_s", 0.0)),
                    tool_calls=t.get("tool_calls") or None,
                )
                for t in obj["turns"]
            ]
            return cls(id=str(obj["id"]), prefix=prefix, turns=turns)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a trace session: {e!r}") from e


def save(sessions: Iterable[Session], path: str | Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for s in sessions:
            f.write(json.dumps(s.to_json(), ensure_ascii=False) + "\n")


def load(path: str | Path) -> list[Session]:
    sessions: list[Session] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                sessions.append(Session.from_json(json.loads(line)))
            except (json.JSONDecodeError, ValueError) as e:
                raise ValueError(f"{path}:{lineno}: {e}") from e
    return sessions


def with_fixed_wait(sessions: list[Session], wait_s: float) -> list[Session]:
    """The same trace with every tool wait set to `wait_s` (the published study's 0.5 / 5 / 60 s runs)."""
    return [replace(s, turns=[replace(t, wait_s=wait_s) for t in s.turns]) for s in sessions]


def truncate(sessions: list[Session], *, max_sessions: int | None, max_turns: int | None) -> list[Session]:
    """Scale a recorded trace down: the first sessions, and the first turns of each."""
    picked = sessions if max_sessions is None else sessions[:max_sessions]
    if max_turns is None:
        return list(picked)
    return [replace(s, turns=s.turns[:max_turns]) for s in picked]


def flatten_tools(sessions: list[Session]) -> list[Session]:
    """The same conversations written with system/user/assistant string messages only.

    For servers whose chat template has no tool support: tool definitions go into the system prompt,
    tool calls into the assistant text, tool results become user messages. Apply to every engine of a
    comparison alike, so they still see identical prompts.
    """
    out = []
    for s in sessions:
        tools_text = "\n".join(json.dumps(t, sort_keys=True) for t in s.prefix.tools)
        prefix_msgs = [_flat(m) for m in s.prefix.messages]
        if tools_text:
            block = "\n\nYou can call these tools:\n" + tools_text
            if prefix_msgs and prefix_msgs[0]["role"] == "system":
                prefix_msgs[0] = {"role": "system", "content": prefix_msgs[0]["content"] + block}
            else:
                prefix_msgs.insert(0, {"role": "system", "content": block.strip()})
        turns = [
            replace(
                t,
                messages=[_flat(m) for m in t.messages],
                output=_flat(t.assistant_message())["content"],
                tool_calls=None,
            )
            for t in s.turns
        ]
        out.append(Session(id=s.id, prefix=Prefix(prefix_msgs, []), turns=turns))
    return out


def _flat(msg: Message) -> Message:
    content = content_text(msg.get("content"))
    role = msg.get("role", "user")
    if role == "tool":
        return {"role": "user", "content": f"[tool result]\n{content}"}
    if role == "assistant" and msg.get("tool_calls"):
        calls = "\n".join(
            f"<tool_call>{json.dumps(c.get('function', c), sort_keys=True)}</tool_call>"
            for c in msg["tool_calls"]
        )
        content = f"{content}\n{calls}" if content else calls
    return {"role": role if role in ("system", "user", "assistant") else "user", "content": content}


def content_text(content: Any) -> str:
    """Message content as one string: OpenAI content may be a list of typed parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if isinstance(p, dict):
                parts.append(str(p.get("text", "")))
            else:
                parts.append(str(p))
        return "".join(parts)
    return str(content)
