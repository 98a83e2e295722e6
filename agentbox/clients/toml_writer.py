"""A small TOML writer for config files we merge into (tomllib reads; nothing in stdlib writes).

Covers what client configs hold: strings, numbers, booleans, arrays of scalars, nested tables and
arrays of tables. Comments in the original file do not survive; the backup keeps them.
"""

from __future__ import annotations

import json
import re
from typing import Any

BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _key(k: str) -> str:
    return k if BARE_KEY.match(k) else json.dumps(k)


def _scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)  # a JSON string is a valid TOML basic string
    if isinstance(v, list):
        return "[" + ", ".join(_scalar(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{_key(k)} = {_scalar(x)}" for k, x in v.items()) + " }"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def _is_table_array(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(x, dict) for x in v)


def dumps(data: dict[str, Any]) -> str:
    lines: list[str] = []
    _table(data, [], lines)
    return "\n".join(lines).strip("\n") + "\n"


def _table(data: dict[str, Any], path: list[str], lines: list[str]) -> None:
    for k, v in data.items():
        if not isinstance(v, dict) and not _is_table_array(v):
            lines.append(f"{_key(k)} = {_scalar(v)}")
    for k, v in data.items():
        if isinstance(v, dict):
            sub = [*path, k]
            if any(not isinstance(x, dict) and not _is_table_array(x) for x in v.values()) or not v:
                lines += ["", "[" + ".".join(_key(p) for p in sub) + "]"]
            _table(v, sub, lines)
        elif _is_table_array(v):
            for item in v:
                lines += ["", "[[" + ".".join(_key(p) for p in [*path, k]) + "]]"]
                _table(item, [*path, k], lines)
