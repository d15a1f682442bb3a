"""Import graphs read from source (every import, lazy ones inside functions included; nothing is
run) and the circles in them: the layering tests of the runtime, the benchmarks and the site."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path


def imported_names(path: Path) -> list[str]:
    """The dotted names a file imports at level 0: `import a.b` -> a.b; `from a import b` -> a
    and a.b (b may be a module of a)."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names]
    return names


def module_graph(dirs: Iterable[Path], package: str) -> dict[str, set[str]]:
    """The modules of `package` (dotted, its files in `dirs`) -> those of them each imports."""
    files = {f.stem: f for d in dirs for f in sorted(d.glob("*.py"))}
    prefix = package.split(".")
    graph: dict[str, set[str]] = {}
    for stem, path in files.items():
        found = set()
        for name in imported_names(path):
            parts = name.split(".")
            head, rest = parts[: len(prefix)], parts[len(prefix) :]
            if head == prefix and rest and rest[0] in files:
                found.add(rest[0])
        graph[stem] = found - {stem, "__init__"}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found
