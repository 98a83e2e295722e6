"""The engine stays readable: no function in agentbox/engine/ longer than 50 lines (a long one is split
into named steps). Measured with ast, decorators aside: end_lineno - lineno + 1 of every def."""

from __future__ import annotations

import ast
from pathlib import Path

import agentbox

MAX_LINES = 50
ENGINE = Path(agentbox.__file__).parent / "engine"


def long_functions(root: Path, limit: int) -> list[str]:
    out: list[str] = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > limit:
                    out.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({lines} lines)")
    return out


def test_no_engine_function_is_longer_than_50_lines() -> None:
    long = long_functions(ENGINE, MAX_LINES)
    assert not long, f"split these into named steps of at most {MAX_LINES} lines: {long}"


def test_the_measure_finds_a_long_function(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    (tmp_path / "m.py").write_text(f"def short():\n    pass\n\n\ndef long():\n{body}\n")
    assert long_functions(tmp_path, MAX_LINES) == [f"{tmp_path.name}/m.py:5 long ({MAX_LINES + 1} lines)"]
