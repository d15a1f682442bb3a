"""Static scan for `pytest.mark.card(...)` bindings: the board's counts and the gate's list of
files that must be collected (no test is imported).

Arguments resolve through what a reader sees in the module: string literals, module-level
names bound to strings or tuples / lists of strings (`CARD = "P0-007"`, `BOTH = ("a", "b")`,
`*BOTH`), aliases of the marker (`P = pytest.mark.card`) and module `pytestmark`. A marker
whose arguments do not resolve this way is not counted (the gate's collection still sees it).
"""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass
from pathlib import Path

SKIP_DIRS = frozenset(
    {".git", ".venv", ".nox", "node_modules", "target", "build", "dist", "worklog", "kanban"}
)


@dataclass(frozen=True)
class Binding:
    path: str  # relative to the scanned root
    card: str
    ref: str


def _is_card_marker(func: ast.expr) -> bool:
    if isinstance(func, ast.Attribute) and func.attr == "card":
        value = func.value
        return (isinstance(value, ast.Attribute) and value.attr == "mark") or (
            isinstance(value, ast.Name) and value.id == "mark"
        )
    return False


def _constants(tree: ast.Module) -> dict[str, tuple[str, ...]]:
    """Module-level names bound once to a string or a tuple / list of strings."""
    found: dict[str, tuple[str, ...]] = {}
    seen: set[str] = set()
    for node in tree.body:
        targets: list[ast.expr] = []
        value: ast.expr | None = None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        for target in targets:
            if not isinstance(target, ast.Name):
                continue
            if target.id in seen:  # rebound: not a constant
                found.pop(target.id, None)
                continue
            seen.add(target.id)
            strings = _strings(value, found)
            if strings is not None:
                found[target.id] = strings
    return found


def _strings(node: ast.expr | None, names: dict[str, tuple[str, ...]]) -> tuple[str, ...] | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return (node.value,)
    if isinstance(node, ast.Name) and node.id in names:
        return names[node.id]
    if isinstance(node, ast.Tuple | ast.List):
        out: list[str] = []
        for element in node.elts:
            inner = element.value if isinstance(element, ast.Starred) else element
            strings = _strings(inner, names)
            if strings is None:
                return None
            out.extend(strings)
        return tuple(out)
    return None


def bindings_in_source(source: str) -> list[tuple[str, str]]:
    """(card_id, item ref) for every `mark.card(...)` call whose arguments resolve."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    names = _constants(tree)
    aliases = {
        target.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and _is_card_marker(node.value)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    found: list[tuple[str, str]] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if not (_is_card_marker(func) or (isinstance(func, ast.Name) and func.id in aliases)):
            continue
        args: list[str] = []
        for arg in node.args:
            inner = arg.value if isinstance(arg, ast.Starred) else arg
            strings = _strings(inner, names)
            if strings is None:
                args = []
                break
            args.extend(strings)
        if len(args) >= 1:
            found.extend((args[0], ref) for ref in args[1:])
    return found


def scan_files(root: Path) -> list[Binding]:
    """Every resolvable binding under `root`, with the file it is in."""
    found: list[Binding] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            path = Path(dirpath) / name
            try:
                source = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            if "mark.card" not in source:
                continue
            rel = path.relative_to(root).as_posix()
            found.extend(Binding(rel, card, ref) for card, ref in bindings_in_source(source))
    return found


def scan_bindings(root: Path) -> list[tuple[str, str]]:
    return [(b.card, b.ref) for b in scan_files(root)]


def files_bound_to(root: Path, card_id: str) -> list[str]:
    """The test files a static scan finds bound to `card_id` (the gate collects each)."""
    return sorted({b.path for b in scan_files(root) if b.card == card_id})
