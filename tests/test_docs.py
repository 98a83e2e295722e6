"""The README is a front page that stays true: its two commands are the ones CI runs, every link stays
inside the repository, and every `agentbox plan` example is the command's real output."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _doc_plans():  # noqa: ANN202 - the script module
    spec = importlib.util.spec_from_file_location("doc_plans", ROOT / "scripts" / "doc_plans.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_opens_with_the_two_commands_ci_runs() -> None:
    text = README.read_text()
    first_block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].strip() for line in first_block.splitlines()]
    assert commands == ["./install.sh && .venv/bin/agentbox serve",
                        "./install.sh --dev && .venv/bin/python -m pytest -q"]
    assert text.index("```bash") < 1000  # on the first screen
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    # both, in order: the suite runs beside the server the first one leaves running
    assert ci.index(commands[0]) < ci.index(commands[1]), ci


def test_the_readme_is_a_front_page() -> None:
    text = README.read_text()
    assert len(text) < 8000, len(text)  # two minutes of reading; the rest lives in docs/
    for needle in ("SmolLM2-135M-Instruct:embedded", "curl ", "from openai import OpenAI",
                   "--model Qwen3-8B", "agentbox setup claude", "agentbox launch claude", "Not yet run on a GPU"):
        assert needle in text, needle


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_link_stays_inside_the_repository(doc: Path) -> None:
    for target in LINK.findall(doc.read_text()):
        if target.startswith(("http://", "https://", "#", "mailto:")):
            continue
        path = (doc.parent / target.split("#")[0]).resolve()
        assert path.is_relative_to(ROOT), f"{doc.name} links outside the repository: {target}"
        assert path.exists(), f"{doc.name} links to a missing file: {target}"


@pytest.mark.slow
def test_every_plan_example_is_the_real_output() -> None:
    plans = _doc_plans()
    seen = 0
    for doc in DOCS:
        for command, written in plans.examples(doc.read_text()):
            assert written == plans.plan_output(command), (
                f"{doc.name}: `{command}` no longer prints what is written; run scripts/doc_plans.py")
            seen += 1
    assert seen >= 5
