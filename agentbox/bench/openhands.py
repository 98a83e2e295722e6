"""Convert OpenHands-style trajectories (as in the SWE-rebench OpenHands trajectories) into replay sessions.

Accepted files (read locally, never downloaded): a JSON list of messages (one trajectory); a JSON object
with the messages under "messages" or "trajectory" (tools under "tools", an id under "instance_id" or
"id"); a JSON list of such objects; or JSONL with one such object per line. Messages are OpenAI chat
messages: role, content (a string or a list of text parts), assistant tool_calls, tool results with
tool_call_id.

A turn ends at each assistant message: the messages since the previous assistant message are what the
turn appends, the assistant message is its recorded output. Leading system messages and the tools are the
shared prefix; trailing messages after the last assistant message are dropped (nothing answered them).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from agentbox.trace import Message, Prefix, Session, Turn, content_text, estimate_tokens

_KEEP_KEYS = ("role", "content", "tool_calls", "tool_call_id", "name")


def load_trajectories(path: str | Path) -> list[dict[str, Any]]:
    """The trajectories in a file, each as {"id", "messages", "tools"}."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    try:
        data: Any = json.loads(text)
        items = _items(data)
    except json.JSONDecodeError:
        items = [obj for line in text.splitlines() if line.strip() for obj in _items(json.loads(line))]
    out = []
    for i, item in enumerate(items):
        if isinstance(item, list):
            item = {"messages": item}
        messages = item.get("messages") or item.get("trajectory")
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"{path}: trajectory {i} has no message list")
        out.append(
            {
                "id": str(item.get("instance_id") or item.get("id") or f"{path.stem}-{i}"),
                "messages": messages,
                "tools": list(item.get("tools") or []),
            }
        )
    return out


def _items(data: Any) -> list[Any]:
    # A bare list of messages is one trajectory; a list of lists/objects is many.
    if isinstance(data, list):
        if data and isinstance(data[0], dict) and "role" in data[0]:
            return [data]
        return data
    if isinstance(data, dict):
        return [data]
    raise ValueError("expected a JSON list or object")


def convert(trajectory: dict[str, Any], wait_s: float = 0.5) -> Session:
    """One trajectory as a replay session; every tool wait is `wait_s` (the traces carry no timing)."""
    messages = [_clean(m) for m in trajectory["messages"]]
    n_sys = 0
    while n_sys < len(messages) and messages[n_sys]["role"] == "system":
        n_sys += 1
    prefix = Prefix(messages=messages[:n_sys], tools=list(trajectory.get("tools") or []))
    turns: list[Turn] = []
    pending: list[Message] = []
    for m in messages[n_sys:]:
        if m["role"] != "assistant":
            pending.append(m)
            continue
        if not pending and not turns:
            continue  # an answer to nothing: cannot be replayed as a request
        output = content_text(m.get("content"))
        calls = m.get("tool_calls") or None
        counted = output + (json.dumps(calls) if calls else "")
        turns.append(
            Turn(
                messages=pending,
                output=output,
                output_tokens=max(1, estimate_tokens(counted)),
                wait_s=wait_s,
                tool_calls=calls,
            )
        )
        pending = []
    if not turns:
        raise ValueError(f"trajectory {trajectory.get('id')} has no assistant turn")
    turns[-1].wait_s = 0.0
    return Session(id=str(trajectory.get("id", "openhands")), prefix=prefix, turns=turns)


def convert_file(path: str | Path, wait_s: float = 0.5) -> list[Session]:
    return [convert(t, wait_s) for t in load_trajectories(path)]


def _clean(msg: dict[str, Any]) -> Message:
    """Keep the chat fields, content as one string (some engines reject typed parts)."""
    out: Message = {k: msg[k] for k in _KEEP_KEYS if k in msg and msg[k] is not None}
    out["role"] = str(msg.get("role", "user"))
    out["content"] = content_text(msg.get("content"))
    if out["role"] != "tool":
        out.pop("name", None)
        out.pop("tool_call_id", None)
    if out["role"] != "assistant":
        out.pop("tool_calls", None)
    return out
