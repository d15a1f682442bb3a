"""`pip install minisgl` then `python -m minisgl`: every module the server imports comes with a
plain install (no extra needed)."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

PKG = Path(__file__).resolve().parents[2]
DIST = {"zmq": "pyzmq", "yaml": "pyyaml"}  # import name -> distribution name


def imported_top_levels(files) -> set[str]:
    names = set()
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"minisgl", "__future__"}


def test_server_imports_are_plain_dependencies():
    meta = tomllib.loads((PKG / "pyproject.toml").read_text())["project"]
    deps = {re.split(r"[<>=!~\[ ;]", d)[0].lower() for d in meta["dependencies"]}
    src = PKG / "src" / "minisgl"
    files = [*(src / "server").glob("*.py"), *(src / "tokenizer").glob("*.py"),
             *(src / "message").glob("*.py"), src / "__main__.py"]  # fmt: skip
    needed = {DIST.get(n, n).lower() for n in imported_top_levels(files)}
    assert needed <= deps, f"server imports outside the plain dependencies: {needed - deps}"
