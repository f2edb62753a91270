"""No import circle in holdfast's packages, counted the strict way: every import statement
anywhere in a module (inside functions and under `if TYPE_CHECKING:` too), and
`from pkg import name` as importing both `pkg` and, where it is a module, `pkg.name`."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = (
    "cachedaemon",
    "supervisor",
    "engine",
    "chaos",
    "holdfast_contract",
    "holdfast_fork",
    "holdfast_vllm",
)


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    paths = (p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py")))
    return {module_name(p): p for p in paths}


def imports_of(name: str, source: str, *, package: bool = False) -> set[str]:
    """Every module a module's statements name, wherever they stand: `pkg` and `pkg.name`
    for `from pkg import name` (only the names that are modules are kept later). A package
    above an imported module does not count: Python runs it first whoever imports."""
    here = name if package else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package `level` floors up
                above = here.rsplit(".", node.level - 1)[0]
                base = f"{above}.{base}" if base else above
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        named = imports_of(name, path.read_text(), package=path.name == "__init__.py")
        graph[name] = {m for m in named if m in modules and m != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while (member := stack.pop()) != node:
                component.append(member)
            if component:
                found.append(sorted([*component, node]))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def one_circle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest way from the component's first module back to itself, for the message."""
    start = component[0]
    paths = {start: [start]}
    queue = [start]
    for node in queue:
        for nxt in sorted(graph[node] & set(component)):
            if nxt == start:
                return [*paths[node], start]
            if nxt not in paths:
                paths[nxt] = [*paths[node], nxt]
                queue.append(nxt)
    raise AssertionError(f"{component} is not strongly connected")


SOURCE = """
import a.b
from c import d
from . import e
from .f import g


def h():
    from i import j


if TYPE_CHECKING:
    from k.l import m
"""


def test_every_import_counts_wherever_it_stands() -> None:
    want = {"a.b", "c", "c.d", "p", "p.e", "p.f", "p.f.g", "i", "i.j", "k.l", "k.l.m"}
    assert imports_of("p.q", SOURCE) == want
    assert "p.q.e" in imports_of("p.q", SOURCE, package=True)
    graph = import_graph()
    assert len(graph) > 150, sorted(graph)
    assert "holdfast_contract.errors" in graph["supervisor.errors"]


def test_a_circle_is_found_and_named() -> None:
    toy = {"a": {"b"}, "b": {"c", "d"}, "c": {"a"}, "d": {"a"}, "e": {"a"}}
    assert circles(toy) == [["a", "b", "c", "d"]]
    assert one_circle(toy, ["a", "b", "c", "d"]) == ["a", "b", "c", "a"]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_itself_back() -> None:
    graph = import_graph()
    found = circles(graph)
    assert not found, "import circles (a way round each, then all it joins):\n" + "\n".join(
        f"{' -> '.join(one_circle(graph, c))}  [{', '.join(c)}]" for c in found
    )


# packages that must not import one another, wherever the import stands: the fork server
# serves both engine kinds, and neither engine kind imports the other
APART = {
    "holdfast_fork": ("engine", "holdfast_vllm", "supervisor", "chaos"),
    "engine": ("holdfast_vllm", "supervisor"),
    "holdfast_vllm": ("engine", "supervisor"),
}


def test_the_fork_server_and_the_engine_kinds_keep_apart() -> None:
    graph = import_graph()
    found = sorted(
        f"{name} imports {dep}"
        for name, deps in graph.items()
        for dep in deps
        if dep.split(".")[0] in APART.get(name.split(".")[0], ())
    )
    assert not found, "\n".join(found)
