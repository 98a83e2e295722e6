"""docs/architecture.md's claims, checked against the code: who writes each field of a `Request`, and that every
file its "Where to add" section tells a maintainer to copy exists. (The import rules it states are
tests/test_import_graph.py's.)

The writers are found with `ast`: every assignment (plain, augmented, annotated, or into a tuple) to an attribute
named like a `Request` field on an expression that names a request in the engine's code (`req`, `r`, `request`,
`victim`, `seq`, or an attribute ending `.request` / `.req`), in every module under agentbox/engine/ but
request.py itself. The runner never writes one: it reads requests and their cache handles and reports what moved.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

from agentbox.engine.request import Request

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
REQUEST_NAMES = {"req", "r", "request", "victim", "seq"}


def _is_request(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return node.id in REQUEST_NAMES
    return isinstance(node, ast.Attribute) and node.attr in ("request", "req")


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        out: list[ast.expr] = []
        for t in node.targets:
            out += t.elts if isinstance(t, ast.Tuple) else [t]
        return out
    if isinstance(node, ast.AugAssign | ast.AnnAssign):
        return [node.target]
    return []


def request_writers(root: Path = ROOT) -> dict[str, set[str]]:
    """Request field -> the engine modules (paths from the repository root) that assign it."""
    fields = {f.name for f in dataclasses.fields(Request)}
    found: dict[str, set[str]] = {}
    for path in sorted((root / "agentbox" / "engine").rglob("*.py")):
        if path.name == "request.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for t in _targets(node):
                if isinstance(t, ast.Attribute) and t.attr in fields and _is_request(t.value):
                    found.setdefault(t.attr, set()).add(str(path.relative_to(root)))
    return found


def documented_writers(text: str) -> dict[str, str]:
    """The table under "Who writes a request": field -> its one writer module."""
    section = text.split("### Who writes a request", 1)[1].split("\n## ", 1)[0]
    out: dict[str, str] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[1].startswith("`engine/"):
            for field in re.findall(r"`(\w+)`", cells[0]):
                out[field] = "agentbox/" + cells[1].strip("`")
    return out


def test_every_request_field_has_the_one_writer_the_architecture_doc_names() -> None:
    documented = documented_writers(DOC.read_text())
    assert "num_computed_tokens" in documented and "cache_handle" in documented  # the table was read
    found = request_writers()
    assert found, "the scan found no writes at all"
    several = {f: sorted(m) for f, m in found.items() if len(m) > 1}
    assert not several, f"fields with more than one writer: {several}"
    actual = {f: next(iter(m)) for f, m in found.items()}
    assert actual == documented, (
        "docs/architecture.md's 'Who writes a request' table and the code disagree:\n"
        + "\n".join(f"  {f}: doc {documented.get(f)}, code {actual.get(f)}" for f in sorted(set(actual) | set(documented))
                    if documented.get(f) != actual.get(f)))
    assert not any(m.startswith("agentbox/engine/exec/") for m in actual.values())  # the runner only reads


def test_the_writer_scan_sees_a_second_writer(tmp_path: Path) -> None:
    """A check that parsed nothing would pass: a planted second writer is found."""
    engine = tmp_path / "agentbox" / "engine"
    (engine / "exec").mkdir(parents=True)
    (engine / "scheduler.py").write_text("def f(req):\n    req.num_computed_tokens = 0\n")
    (engine / "exec" / "runner.py").write_text("def g(s):\n    s.request.num_computed_tokens += 1\n"
                                               "    x.status, r.flushing = 1, True\n")
    assert request_writers(tmp_path) == {
        "num_computed_tokens": {"agentbox/engine/scheduler.py", "agentbox/engine/exec/runner.py"},
        "flushing": {"agentbox/engine/exec/runner.py"},
    }


def test_the_files_the_doc_says_to_copy_exist() -> None:
    section = DOC.read_text().split("## Where to add", 1)[1]
    paths = set(re.findall(r"`((?:models|layers|engine|server|cli|tests|kernels)/[\w/]+\.py)`", section))
    assert len(paths) >= 15, paths
    missing = [p for p in sorted(paths) if not ((ROOT / "agentbox" / p).is_file() or (ROOT / p).is_file())]
    assert not missing, f"docs/architecture.md names files that do not exist: {missing}"
