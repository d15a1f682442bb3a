"""Static scan for `pytest.mark.card(...)` bindings (for the board; no test is imported).

The gate's runtime collection is authoritative; this scan only counts bound items quickly.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

SKIP_DIRS = frozenset(
    {".git", ".venv", ".nox", "node_modules", "target", "build", "dist", "worklog", "kanban"}
)


def _is_card_marker(func: ast.expr) -> bool:
    if isinstance(func, ast.Attribute) and func.attr == "card":
        value = func.value
        return (isinstance(value, ast.Attribute) and value.attr == "mark") or (
            isinstance(value, ast.Name) and value.id == "mark"
        )
    return False


def bindings_in_source(source: str) -> list[tuple[str, str]]:
    """(card_id, item ref) for every literal `mark.card("ID", "item", ...)` call.

    Also follows simple aliases: `C = pytest.mark.card` then `@C("ID", "item")`.
    """
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
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
        if _is_card_marker(func) or (isinstance(func, ast.Name) and func.id in aliases):
            args = [a.value for a in node.args if isinstance(a, ast.Constant)]
            if args and all(isinstance(a, str) for a in args):
                found.extend((args[0], ref) for ref in args[1:])
    return found


def scan_bindings(root: Path) -> list[tuple[str, str]]:
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
            if "mark.card" in source:
                found.extend(bindings_in_source(source))
    return found
