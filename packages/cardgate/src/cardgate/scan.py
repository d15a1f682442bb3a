"""Static scan for `pytest.mark.card(...)` bindings: the board's counts and the gate's list of
files that must be collected (no test is imported).

Arguments resolve through what a reader sees in the module: string literals, module-level
names bound to strings or tuples / lists of strings (`CARD = "P0-007"`, `BOTH = ("a", "b")`,
`*BOTH`), subscripts of module-level dicts and tuples / lists of those with a literal key
(`ITEMS["main"]`, `KEYS[0]`), aliases of the marker (`P = pytest.mark.card`) and module
`pytestmark`. A marker whose arguments do not resolve this way is listed by
`unreadable_markers` (a board lint error: the board could not count what the gate binds).

`scan_tests` lists the bound test functions themselves (file, node-id name, lines): the gate
compares them with the tests pytest ran, per function.
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


@dataclass(frozen=True)
class Unreadable:
    path: str
    line: int
    source: str


_Names = dict[str, tuple[str, ...]]
_Tables = dict[str, dict[object, tuple[str, ...]]]


def _tables(tree: ast.Module, names: _Names) -> _Tables:
    """Module-level names bound once to a dict with constant keys, or a tuple / list, whose
    values resolve to strings: what `ITEMS["main"]` or `KEYS[0]` reads."""
    found: _Tables = {}
    seen: set[str] = set()
    for node in tree.body:
        if not isinstance(node, ast.Assign | ast.AnnAssign) or node.value is None:
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for target in targets:
            if not isinstance(target, ast.Name):
                continue
            if target.id in seen:
                found.pop(target.id, None)
                continue
            seen.add(target.id)
            table = _table(node.value, names)
            if table is not None:
                found[target.id] = table
    return found


def _table(node: ast.expr, names: _Names) -> dict[object, tuple[str, ...]] | None:
    if isinstance(node, ast.Dict):
        out: dict[object, tuple[str, ...]] = {}
        for key, value in zip(node.keys, node.values, strict=True):
            if not isinstance(key, ast.Constant):
                return None
            strings = _strings(value, names)
            if strings is None:
                return None
            out[key.value] = strings
        return out
    if isinstance(node, ast.Tuple | ast.List) and not any(
        isinstance(e, ast.Starred) for e in node.elts
    ):
        items = [_strings(e, names) for e in node.elts]
        if any(i is None for i in items):
            return None
        return {index: i for index, i in enumerate(items) if i is not None}
    return None


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


def _strings(
    node: ast.expr | None, names: _Names, tables: _Tables | None = None
) -> tuple[str, ...] | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return (node.value,)
    if isinstance(node, ast.Name) and node.id in names:
        return names[node.id]
    if (
        tables
        and isinstance(node, ast.Subscript)
        and isinstance(node.value, ast.Name)
        and node.value.id in tables
        and isinstance(node.slice, ast.Constant)
    ):
        return tables[node.value.id].get(node.slice.value)
    if isinstance(node, ast.Tuple | ast.List):
        out: list[str] = []
        for element in node.elts:
            inner = element.value if isinstance(element, ast.Starred) else element
            strings = _strings(inner, names, tables)
            if strings is None:
                return None
            out.extend(strings)
        return tuple(out)
    return None


def bindings_in_source(source: str) -> list[tuple[str, str]]:
    """(card_id, item ref) for every `mark.card(...)` call whose arguments resolve."""
    return markers_in_source(source)[0]


def _aliases(tree: ast.Module) -> set[str]:
    """Names bound to the marker itself (`P = pytest.mark.card`)."""
    return {
        target.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and _is_card_marker(node.value)
        for target in node.targets
        if isinstance(target, ast.Name)
    }


def _is_marker_call(node: ast.AST, aliases: set[str]) -> bool:
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    return _is_card_marker(func) or (isinstance(func, ast.Name) and func.id in aliases)


def _call_args(node: ast.Call, names: _Names, tables: _Tables) -> list[str] | None:
    """The marker call's arguments as strings, or None when one does not resolve."""
    args: list[str] = []
    for arg in node.args:
        inner = arg.value if isinstance(arg, ast.Starred) else arg
        strings = _strings(inner, names, tables)
        if strings is None:
            return None
        args.extend(strings)
    return args


def markers_in_source(source: str) -> tuple[list[tuple[str, str]], list[tuple[int, str]]]:
    """The resolved bindings, and (line, call text) per `mark.card(...)` call whose arguments
    do not resolve statically."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return [], []
    names = _constants(tree)
    tables = _tables(tree, names)
    aliases = _aliases(tree)
    found: list[tuple[str, str]] = []
    unreadable: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not _is_marker_call(node, aliases):
            continue
        args = _call_args(node, names, tables)
        if args is None:
            unreadable.append((node.lineno, ast.get_source_segment(source, node) or ""))
            continue
        if len(args) >= 1:
            found.extend((args[0], ref) for ref in args[1:])
    return found, sorted(unreadable)


@dataclass(frozen=True)
class BoundTest:
    """A test function or method the static scan finds bound to a card item: `name` as a node
    id names it (`test_x`, `TestGroup::test_y`), `first`..`last` its lines, decorators
    included (where pytest places a decorated test)."""

    path: str
    name: str
    first: int
    last: int
    card: str
    ref: str

    @property
    def nodeid(self) -> str:
        return f"{self.path}::{self.name}"


_Bindings = list[tuple[str, str]]


class _TestScan:
    """Bound test functions of one module: direct markers (decorators, also inside
    `parametrize` marks), module-level marker names (`ONE = pytest.mark.card(...)`), and
    module or class `pytestmark`, which bind the `test*` functions of collected classes."""

    def __init__(self, tree: ast.Module) -> None:
        self.names = _constants(tree)
        self.tables = _tables(tree, self.names)
        self.aliases = _aliases(tree)
        self.marks: dict[str, _Bindings] = {}
        for node in tree.body:
            if isinstance(node, ast.Assign) and _is_marker_call(node.value, self.aliases):
                for target in node.targets:
                    if isinstance(target, ast.Name) and target.id != "pytestmark":
                        self.marks[target.id] = self.bindings(node.value)

    def bindings(self, node: ast.AST) -> _Bindings:
        found: _Bindings = []
        for sub in ast.walk(node):
            if isinstance(sub, ast.Call) and _is_marker_call(sub, self.aliases):
                args = _call_args(sub, self.names, self.tables)
                if args:
                    found.extend((args[0], ref) for ref in args[1:])
            elif isinstance(sub, ast.Name) and sub.id in self.marks:
                found.extend(self.marks[sub.id])
        return found

    def pytestmark(self, body: list[ast.stmt]) -> _Bindings:
        found: _Bindings = []
        for node in body:
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets
            ):
                found.extend(self.bindings(node.value))
        return found

    def walk(
        self, body: list[ast.stmt], prefix: str, inherited: _Bindings, collected: bool
    ) -> list[tuple[str, int, int, str, str]]:
        out: list[tuple[str, int, int, str, str]] = []
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                if not node.name.startswith("test"):
                    continue
                own = [b for d in node.decorator_list for b in self.bindings(d)]
                marks = own + (inherited if collected else [])
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                last = node.end_lineno or node.lineno
                for card, ref in dict.fromkeys(marks):
                    out.append((prefix + node.name, first, last, card, ref))
            elif isinstance(node, ast.ClassDef):
                own = [b for d in node.decorator_list for b in self.bindings(d)]
                is_test = node.name.startswith("Test") or any(
                    (isinstance(b, ast.Name) and b.id.endswith("TestCase"))
                    or (isinstance(b, ast.Attribute) and b.attr.endswith("TestCase"))
                    for b in node.bases
                )
                marks = inherited + own + self.pytestmark(node.body)
                out.extend(self.walk(node.body, f"{prefix}{node.name}::", marks, is_test))
        return out


def tests_in_source(source: str) -> list[tuple[str, int, int, str, str]]:
    """(name, first line, last line, card id, item ref) per bound test function or method."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    scan = _TestScan(tree)
    return scan.walk(tree.body, "", scan.pytestmark(tree.body), True)


def _sources(root: Path) -> list[tuple[str, str]]:
    """(relative path, source) of every Python file under `root` that mentions `mark.card`."""
    found: list[tuple[str, str]] = []
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
            found.append((path.relative_to(root).as_posix(), source))
    return found


def scan_files(root: Path) -> list[Binding]:
    """Every resolvable binding under `root`, with the file it is in."""
    return [
        Binding(rel, card, ref)
        for rel, source in _sources(root)
        for card, ref in bindings_in_source(source)
    ]


def scan_tests(root: Path) -> list[BoundTest]:
    """Every bound test function or method under `root` (what the gate expects to run)."""
    return [
        BoundTest(rel, name, first, last, card, ref)
        for rel, source in _sources(root)
        for name, first, last, card, ref in tests_in_source(source)
    ]


def unreadable_markers(root: Path) -> list[Unreadable]:
    """Every `mark.card(...)` call under `root` whose arguments the static scan cannot read."""
    return [
        Unreadable(rel, line, text)
        for rel, source in _sources(root)
        for line, text in markers_in_source(source)[1]
    ]


def scan_bindings(root: Path) -> list[tuple[str, str]]:
    return [(b.card, b.ref) for b in scan_files(root)]


def files_bound_to(root: Path, card_id: str) -> list[str]:
    """The test files a static scan finds bound to `card_id` (the gate collects each)."""
    return sorted({b.path for b in scan_files(root) if b.card == card_id})
