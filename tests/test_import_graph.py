"""The package's import graph, computed from the source with `ast`: no cycle between modules of different
files (imports under `if TYPE_CHECKING:` included: a cycle of type hints is a cycle of meaning), no import from
a lower package into a higher one, and the scheduler and the core reach the cache through engine/cache/manager.py
alone (docs/architecture.md, "Packages and the direction of imports").

An import inside a function counts (it runs when the function is called), and so does
`importlib.import_module("a.literal.name")`; for the direction of imports, one under `if TYPE_CHECKING:` does not
(a lower package may name a higher one's types in hints). The top-level kernels/
folder counts as `agentbox.kernels` (setup.py maps it).
Importing an ancestor package is no edge: Python has imported every ancestor before the module itself runs.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# module -> {imported module: where (path:line)}
Graph = dict[str, dict[str, str]]


@dataclass(frozen=True)
class Layer:
    """The modules under any of `under` (dotted prefixes), less those under any of `but`."""

    under: tuple[str, ...]
    but: tuple[str, ...] = ()

    def __contains__(self, module: object) -> bool:
        def inside(prefix: str) -> bool:
            return module == prefix or str(module).startswith(prefix + ".")

        return any(map(inside, self.under)) and not any(map(inside, self.but))


@dataclass(frozen=True)
class Rule:
    """Modules of `lower` must not import modules of `higher`."""

    lower: Layer
    higher: Layer
    why: str


def layer(*under: str, but: tuple[str, ...] = ()) -> Layer:
    """`layer("engine", but=("engine.exec",))`: names relative to agentbox ("" is agentbox itself)."""

    def full(name: str) -> str:
        return f"agentbox.{name}" if name else "agentbox"

    return Layer(tuple(map(full, under)), tuple(map(full, but)))


ENGINE = layer("engine")
ENGINE_CORE = layer("engine", but=("engine.exec",))  # engine/*.py, engine/cache/, engine/ipc/
RULES = (
    Rule(layer("parallel"), ENGINE, "parallel/ is process groups and collectives; the engine uses it"),
    Rule(layer("engine.exec"), ENGINE_CORE,
         "engine/exec/ runs the step it is handed (StepInputs); scheduling, the cache and ipc sit above it"),
    Rule(layer("hw"), layer("hub"), "hw/ probes the machine; hub/ plans models from it"),
    Rule(layer("layers"), layer("models"), "models compose layers, never the reverse"),
    Rule(layer("models", "layers"), ENGINE, "the engine runs models; models know no engine"),
    Rule(ENGINE, layer("server", "chat"), "the engine sees token ids, never HTTP or chat"),
    Rule(layer("server"), layer("bench"), "bench/ drives a server; the server never needs it"),
    Rule(layer("kernels"), layer("", but=("kernels",)), "kernels/ is the bottom: torch, Triton and C only"),
)


def module_files(root: Path) -> dict[str, Path]:
    """Every module of agentbox/ under `root`, by dotted name."""
    files: dict[str, Path] = {}
    for path in sorted((root / "agentbox").rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def _type_checking_only(tree: ast.AST) -> set[int]:
    """The ids of the nodes under `if TYPE_CHECKING:` (its else branch runs)."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def _imported_names(module: str, is_package: bool, node: ast.AST) -> list[str]:
    """The dotted names one import asks for (a module, or a name inside one); [] for any other node."""
    if isinstance(node, ast.Call):  # importlib.import_module("agentbox.x"): a lazy import, still an edge
        named = ast.unparse(node.func) in ("importlib.import_module", "import_module")
        arg = node.args[0] if named and node.args else None
        return [arg.value] if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else []
    if not isinstance(node, ast.Import | ast.ImportFrom):
        return []
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: from the module's own package, one level up per dot after the first
        package = module.split(".") if is_package else module.split(".")[:-1]
        anchor = package[: len(package) - node.level + 1]
        base = ".".join([*anchor, base] if base else anchor)
    return [f"{base}.{alias.name}" for alias in node.names]


def import_graph(root: Path = ROOT, type_checking: bool = False) -> Graph:
    """Runtime imports; with `type_checking`, the ones under `if TYPE_CHECKING:` too."""
    files = module_files(root)

    def resolve(name: str) -> str | None:  # the module a dotted name lives in (its longest known prefix)
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: Graph = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = set() if type_checking else _type_checking_only(tree)
        edges = graph.setdefault(module, {})
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            for name in _imported_names(module, path.name == "__init__.py", node):
                target = resolve(name)
                if target is None or target == module or module.startswith(target + "."):
                    continue  # outside the package, itself, or an ancestor package (imported already)
                edges.setdefault(target, f"{path.relative_to(root)}:{getattr(node, 'lineno', 0)}")
    return graph


def cycles(graph: Graph) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted, in a stable order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while (w := stack.pop()) != v:
                group.append(w)
            if group:
                found.append(sorted([v, *group]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def cycle_report(graph: Graph, group: list[str]) -> str:
    members = set(group)
    edges = [f"    {graph[a][b]} imports {b}" for a in group for b in sorted(graph[a]) if b in members]
    return "cycle: " + " <-> ".join(group) + "\n" + "\n".join(edges)


def upward(graph: Graph, rules: tuple[Rule, ...] = RULES) -> list[str]:
    """Each import that runs from a lower package into a higher one, naming where it is and the rule."""
    return [f"{where} imports {b}: {rule.why}"
            for a in sorted(graph) for b, where in sorted(graph[a].items())
            for rule in rules if a in rule.lower and b in rule.higher]


@pytest.fixture(scope="module")
def graph() -> Graph:
    return import_graph()


@pytest.fixture(scope="module")
def hint_graph() -> Graph:
    return import_graph(type_checking=True)


def test_no_import_cycles_between_files(hint_graph: Graph) -> None:
    found = cycles(hint_graph)
    assert not found, ("import cycles (type-checking imports included); break each by moving what both sides need "
                       "into a module of its own, or by a Protocol of what one side reads of the other:\n"
                       + "\n".join(cycle_report(hint_graph, g) for g in found))


# The scheduler and the core see the cache through one interface (engine/cache/manager.py): Match, Lock and a
# request's opaque handle. Any other module of engine/cache/ they import is a leak of the cache's insides.
CACHE_FACADE = "agentbox.engine.cache.manager"


def cache_leaks(graph: Graph, modules: tuple[str, ...] = ("agentbox.engine.scheduler", "agentbox.engine.core")) -> list[str]:
    return [f"{where} imports {b}: the cache is reached through {CACHE_FACADE} only"
            for a in modules for b, where in sorted(graph.get(a, {}).items())
            if b.startswith("agentbox.engine.cache") and b != CACHE_FACADE]


def test_the_scheduler_and_the_core_reach_the_cache_through_the_manager_only(hint_graph: Graph) -> None:
    assert CACHE_FACADE in hint_graph["agentbox.engine.scheduler"]  # the check sees the real edge
    assert CACHE_FACADE in hint_graph["agentbox.engine.core"]
    found = cache_leaks(hint_graph)
    assert not found, "\n".join(found)


def test_the_facade_check_fails_on_a_leak() -> None:
    e = "agentbox.engine"
    graph: Graph = {f"{e}.scheduler": {f"{e}.cache.manager": "s:1", f"{e}.cache.radix_node": "s:2"},
                    f"{e}.core": {f"{e}.cache.manager": "c:1"}}
    assert cache_leaks(graph) == ["s:2 imports agentbox.engine.cache.radix_node: the cache is reached through "
                                  f"{CACHE_FACADE} only"]


def test_no_imports_from_a_lower_package_into_a_higher_one(graph: Graph) -> None:
    found = upward(graph)
    assert not found, "imports that run upward:\n" + "\n".join(found)


def test_the_graph_sees_the_real_imports(graph: Graph) -> None:
    """A checker that parsed nothing would pass the two tests above: these edges exist today."""
    assert "agentbox.engine.ipc.client" in graph["agentbox.server.app"]  # a plain `from ... import`
    assert "agentbox.hub.profiles" in graph["agentbox.server.app"]  # an import inside a function
    assert "agentbox.kernels.cpu_gemv" in graph["agentbox.kernels.cpu_bits"]  # kernels/ as agentbox.kernels
    routes = {"agentbox.server.openai_routes", "agentbox.server.sessions_routes"}  # one `from x import a, b`
    assert routes <= set(graph["agentbox.server.app"])


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_checker_fails_on_a_cycle_and_an_upward_import(tmp_path: Path) -> None:
    _write(tmp_path, {
        "agentbox/__init__.py": "",
        "agentbox/hw/__init__.py": "",
        # upward, and half of a cycle: an import inside a function runs too
        "agentbox/hw/probe.py": "def f():\n    from agentbox.hub import plan\n",
        "agentbox/hub/__init__.py": "",
        "agentbox/hub/plan.py": "from ..hw.probe import f\n",  # relative: agentbox.hw.probe
        "agentbox/chat/__init__.py": "",
        # a cycle that is not one at runtime: one side imports under TYPE_CHECKING only
        "agentbox/chat/render.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                   "    from agentbox.chat.harmony import X\n",
        "agentbox/chat/harmony.py": "from . import render\nimport agentbox.chat\n",  # an ancestor: no edge
        "agentbox/kernels/__init__.py": "",
        "agentbox/kernels/gemv.py": "import importlib\ndef f():\n    importlib.import_module('agentbox.hw.probe')\n",
    })
    graph = import_graph(tmp_path)
    assert graph["agentbox.chat.harmony"] == {"agentbox.chat.render": "agentbox/chat/harmony.py:1"}
    assert graph["agentbox.chat.render"] == {}
    assert cycles(graph) == [["agentbox.hub.plan", "agentbox.hw.probe"]]
    hinted = import_graph(tmp_path, type_checking=True)  # the hint-only cycle counts there
    assert cycles(hinted) == [["agentbox.chat.harmony", "agentbox.chat.render"], ["agentbox.hub.plan", "agentbox.hw.probe"]]
    report = cycle_report(graph, cycles(graph)[0])
    assert "agentbox/hw/probe.py:2 imports agentbox.hub.plan" in report
    assert "agentbox/hub/plan.py:1 imports agentbox.hw.probe" in report
    assert upward(graph) == [
        "agentbox/hw/probe.py:2 imports agentbox.hub.plan: " + RULES[2].why,
        "agentbox/kernels/gemv.py:3 imports agentbox.hw.probe: " + RULES[-1].why,
    ]


def test_engine_exec_may_not_import_the_engine_core_but_the_core_may_import_it() -> None:
    e = "agentbox.engine"
    graph: Graph = {
        f"{e}.exec.runner": {f"{e}.scheduler": "r:1", f"{e}.exec.sampler": "r:2"},
        f"{e}.exec.sampler": {f"{e}.cache.sessions": "s:1", "agentbox.layers.linear": "s:2"},
        f"{e}.core": {f"{e}.exec.runner": "c:1", f"{e}.cache.kv_pool": "c:2", f"{e}.ipc.messages": "c:3"},
        "agentbox.parallel.state": {f"{e}.exec.worker": "p:1"},
    }
    assert upward(graph) == [f"r:1 imports agentbox.engine.scheduler: {RULES[1].why}",
                             f"s:1 imports agentbox.engine.cache.sessions: {RULES[1].why}",
                             f"p:1 imports agentbox.engine.exec.worker: {RULES[0].why}"]
