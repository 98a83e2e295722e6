"""Regenerate every `agentbox plan` example in README.md and docs/*.md from the real command's output.

A plan example is a ```console block whose commands are all `$ agentbox plan ...`; each command's output
is replaced by what the command prints at DOC_COLUMNS columns. tests/test_docs.py fails when an example
no longer matches, so an example is never hand-edited:  .venv/bin/python scripts/doc_plans.py"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC_COLUMNS = "100"  # wide enough for a row and its arithmetic on one line, narrow enough to read on GitHub
BLOCK = re.compile(r"```console\n(.*?)```", re.S)
PROMPT = "$ agentbox plan "


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def plan_output(command: str) -> str:
    """What `agentbox plan ...` prints at DOC_COLUMNS columns, run from the repository root."""
    import os

    from typer.testing import CliRunner

    from agentbox.cli.main import app

    args = shlex.split(command[len("$ agentbox "):])
    cwd = os.getcwd()
    os.chdir(ROOT)  # the examples name profiles/hardware/... relative to the root
    try:
        out = CliRunner().invoke(app, args, env={"COLUMNS": DOC_COLUMNS})
    finally:
        os.chdir(cwd)
    if out.exit_code not in (0, 2):  # 2: no variant runs, a valid plan
        raise RuntimeError(f"{command} failed ({out.exit_code}): {out.output}")
    return "\n".join(line.rstrip() for line in out.output.rstrip("\n").split("\n"))


def examples(text: str) -> list[tuple[str, str]]:
    """(command, output as written) for every plan example in a document."""
    found = []
    for block in BLOCK.findall(text):
        lines = block.rstrip("\n").split("\n")
        if not lines or not all(ln.startswith(PROMPT) for ln in lines if ln.startswith("$ ")):
            continue
        current: str | None = None
        body: list[str] = []
        for ln in lines:
            if ln.startswith("$ "):
                if current is not None:
                    found.append((current, "\n".join(body)))
                current, body = ln, []
            else:
                body.append(ln)
        if current is not None:
            found.append((current, "\n".join(body)))
    return found


def regenerate(text: str) -> str:
    def block(m: re.Match[str]) -> str:
        lines = m.group(1).rstrip("\n").split("\n")
        if not lines or not all(ln.startswith(PROMPT) for ln in lines if ln.startswith("$ ")):
            return m.group(0)
        commands = [ln for ln in lines if ln.startswith("$ ")]
        return "```console\n" + "".join(f"{c}\n{plan_output(c)}\n" for c in commands) + "```"

    return BLOCK.sub(block, text)


def main() -> int:
    for path in doc_files():
        text = path.read_text()
        new = regenerate(text)
        if new != text:
            path.write_text(new)
            print(f"regenerated the plan examples in {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
