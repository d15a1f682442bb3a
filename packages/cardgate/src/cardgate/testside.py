"""What a bound test checks, from the test side: taken at collection, kept in a red record, and
compared by the green gate (`verify.red_evidence`).

Per bound test (`pin_test_side(item, root)`):

- `files`: sha256 of the test side that ran: the test module, every `conftest.py` from the
  root down to the module's folder, and the files of the repository fixtures it uses;
- `deps`: sha256 per thing the test's result depends on in those files: each module-level
  name the test reads (its decorators included: `parametrize` values), followed through the
  module-level functions and classes that read others (`EXPECTED`, `helper`, `import impl`);
  the class attributes of a test method's class; and every repository fixture in its closure
  (autouse fixtures included, each with the module-level names it reads).

A red record is refused when a test-side file differs between red and green *and* one of the
bound test's `deps` differs (or appeared, or went away). A change beside the test (another
test in the module, a fixture it does not use) keeps the record. What this cannot see: data
files a test opens, helpers imported from other modules (those are imports: the
implementation side) and anything computed at run time.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import inspect
from pathlib import Path
from typing import Any

import pytest

from cardgate.inventory import _installed_dirs

Defs = dict[str, list[ast.stmt]]


def _sha(text: str | bytes) -> str:
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()


@functools.lru_cache(maxsize=256)
def _parsed(path: str) -> tuple[str, ast.Module, Defs] | None:
    """A module's source, tree and module-level definitions (parsed once per process)."""
    try:
        source = Path(path).read_text(encoding="utf-8")
        tree = ast.parse(source)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return None
    return source, tree, _defs(tree)


def _bound_names(stmt: ast.stmt) -> list[str]:
    if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return [stmt.name]
    if isinstance(stmt, ast.Import | ast.ImportFrom):
        return [(a.asname or a.name).split(".")[0] for a in stmt.names]
    targets: list[ast.expr] = []
    if isinstance(stmt, ast.Assign):
        targets = stmt.targets
    elif isinstance(stmt, ast.AnnAssign | ast.AugAssign):
        targets = [stmt.target]
    return [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]


def _defs(tree: ast.Module) -> Defs:
    """Module-level statements by the names they bind."""
    out: Defs = {}
    for stmt in tree.body:
        for name in _bound_names(stmt):
            out.setdefault(name, []).append(stmt)
    return out


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _definition(tree: ast.Module, name: str, line: int) -> tuple[ast.AST, ast.ClassDef | None]:
    """The def named `name` whose lines (decorators included) hold `line`, and its class."""
    found: tuple[ast.AST, ast.ClassDef | None] | None = None

    def walk(body: list[ast.stmt], cls: ast.ClassDef | None) -> None:
        nonlocal found
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                if first <= line <= (node.end_lineno or node.lineno):
                    found = (node, cls)
            elif isinstance(node, ast.ClassDef):
                walk(node.body, node)

    walk(tree.body, None)
    return found if found is not None else (ast.Module(body=[], type_ignores=[]), None)


def _globals(source: str, defs: Defs, start: set[str], rel: str) -> dict[str, str]:
    """label -> sha256 of the module-level definitions of `start`, followed transitively."""
    out: dict[str, str] = {}
    todo, seen = sorted(start), set()
    while todo:
        name = todo.pop()
        if name in seen or name not in defs:
            continue
        seen.add(name)
        stmts = defs[name]
        out[f"{name} ({rel})"] = _sha(
            "\n".join(ast.get_source_segment(source, s) or "" for s in stmts)
        )
        for stmt in stmts:
            todo.extend(sorted(_names(stmt) - seen))
    return out


def _installed(file: Path) -> bool:
    """A file of the interpreter's folders (a virtualenv kept in the repository: pytest's own
    fixtures are not the test side)."""
    return any(file.is_relative_to(d) for d in _installed_dirs())


def function_deps(func: Any, root: Path, label: str = "") -> tuple[str | None, dict[str, str]]:
    """(file relative to root, label -> sha256) for a function defined under `root`: the
    module-level names it reads (transitively) and, for a method, its class's attributes;
    with `label`, the function's own source too."""
    try:
        func = inspect.unwrap(func)
        file = Path(inspect.getsourcefile(func) or "").resolve()
        line = func.__code__.co_firstlineno
    except (TypeError, AttributeError, ValueError, OSError):
        return None, {}
    if not file.is_file() or not file.is_relative_to(root) or _installed(file):
        return None, {}
    rel = file.relative_to(root).as_posix()
    parsed = _parsed(str(file))
    if parsed is None:
        return rel, {}
    source, tree, defs = parsed
    node, cls = _definition(tree, func.__name__, line)
    start = _names(node)
    out: dict[str, str] = {}
    if label:
        out[f"{label} ({rel})"] = _sha(ast.get_source_segment(source, node) or "")
    if cls is not None:
        attrs = [s for s in cls.body if not isinstance(s, ast.FunctionDef | ast.AsyncFunctionDef)]
        text = "\n".join(ast.get_source_segment(source, s) or "" for s in attrs)
        text += "\n".join(ast.get_source_segment(source, d) or "" for d in cls.decorator_list)
        out[f"class {cls.name} attributes ({rel})"] = _sha(text)
        start |= set().union(*(_names(s) for s in [*attrs, *cls.decorator_list]))
    out.update(_globals(source, defs, start, rel))
    return rel, out


def _file_sha(path: Path) -> str | None:
    try:
        return _sha(path.read_bytes())
    except OSError:
        return None


def _conftests(module: Path, root: Path) -> list[Path]:
    found = []
    folder = module.parent
    while folder.is_relative_to(root):
        if (folder / "conftest.py").is_file():
            found.append(folder / "conftest.py")
        if folder == root:
            break
        folder = folder.parent
    return found


def pin_test_side(item: pytest.Item, root: Path) -> dict[str, dict[str, str]] | None:
    """`files` and `deps` of a bound test (see the module's docstring); None for items that
    are not Python functions under `root`."""
    root = root.resolve()
    obj = getattr(item, "obj", None)
    if obj is None:
        return None
    module, deps = function_deps(obj, root)
    if module is None:
        return None
    files = [root / module, *_conftests(root / module, root)]
    info = getattr(item, "_fixtureinfo", None)
    for name, defs in sorted((getattr(info, "name2fixturedefs", {}) or {}).items()):
        for fixturedef in defs:
            where, fixture = function_deps(fixturedef.func, root, f"fixture {name}")
            if where is not None:
                files.append(root / where)
                deps.update(fixture)
    digests = {p.relative_to(root).as_posix(): _file_sha(p) for p in files}
    return {
        "files": {k: v for k, v in sorted(digests.items()) if v},
        "deps": dict(sorted(deps.items())),
    }
