"""The import graph of ``tracer/``, read from the sources (``ast``): every import counts,
at module level, under ``if TYPE_CHECKING:`` or inside a function alike, since each is
a dependency of one module on another.

No module of ``tracer.proxy`` or ``tracer.faults`` is on a cycle (issue 36): the relay
imports its connections, a connection never imports the relay (it says what it needs
of its tap with a ``Protocol``), and the fault layer's face (``faults/plan.py``) imports
its parts, never the other way round. Cycles elsewhere in the package are reported
(``test_report_cycles`` prints them, ``pytest -s``), not failed on.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "tracer"
ACYCLIC = ("tracer.proxy", "tracer.faults")  # no module of these on any cycle


def modules() -> dict[str, Path]:
    """Every module of the package by its dotted name (a package by its own name)."""
    found: dict[str, Path] = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imported(node: ast.Import | ast.ImportFrom, name: str, is_package: bool) -> Iterator[str]:
    """The dotted names an import statement of module ``name`` may refer to: the module
    imported and, for ``from X import a``, ``X.a`` (a submodule, when it is one)."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name
        return
    if node.level:
        base = name.split(".") if is_package else name.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    yield target
    for alias in node.names:
        yield f"{target}.{alias.name}"


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (the most specific one an import names:
    ``from ..faults.plan import X`` is an edge to ``tracer.faults.plan``, not to
    ``tracer.faults``, whose ``__init__`` runs too but is a package's, not a choice)."""
    mods = modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        edges: set[str] = set()
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            names = list(_imported(node, name, path.name == "__init__.py"))
            submodules = [n for n in names[1:] if n in mods] if names else []
            if isinstance(node, ast.ImportFrom) and submodules:
                edges.update(submodules)
                if len(submodules) < len(node.names) and names[0] in mods:
                    edges.add(names[0])  # some of the names are the package's own
            else:
                edges.update(n for n in names if n in mods)
        edges.discard(name)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def a_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One cycle through the component's first module, for the message."""
    members = set(component)
    start = component[0]
    path = [start]
    seen = {start}

    # depth-first, within the component, back to the start
    def walk(v: str) -> bool:
        for w in sorted(graph[v] & members):
            if w == start:
                return True
            if w not in seen:
                seen.add(w)
                path.append(w)
                if walk(w):
                    return True
                path.pop()
        return False

    walk(start)
    return [*path, start]


def test_graph_reads_the_imports() -> None:
    """The graph is the package's: relative and absolute imports, a ``from`` import of a
    submodule, and a ``TYPE_CHECKING`` import are edges."""
    graph = import_graph()
    assert "tracer.proxy.connection" in graph["tracer.proxy.relay"]
    assert "tracer.proxy.fault_connection" in graph["tracer.proxy.relay"]
    assert "tracer.events" in graph["tracer.proxy.relay"]  # from .. import events as ev
    assert "tracer.faults.connection" in graph["tracer.faults.plan"]
    assert "tracer.proxy.pump" in graph["tracer.proxy.fault_connection"]  # TYPE_CHECKING


def test_cycles_are_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert a_cycle(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]


@pytest.mark.parametrize("package", ACYCLIC)
def test_no_cycle_through(package: str) -> None:
    graph = import_graph()
    bad = [c for c in cycles(graph) if any(m == package or m.startswith(package + ".") for m in c)]
    assert not bad, "import cycles: " + "; ".join(" -> ".join(a_cycle(graph, c)) for c in bad)


def test_report_cycles(capsys: pytest.CaptureFixture[str]) -> None:
    """The package's other cycles, printed (none is a failure here)."""
    graph = import_graph()
    with capsys.disabled():
        for component in cycles(graph):
            print("import cycle:", " -> ".join(a_cycle(graph, component)))
