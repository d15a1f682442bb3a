"""Layers point down (issue 36 item 5): the kernels and the step contract at the bottom, models
and attention above them, the engine, scheduler, runtime, server and benchmarks on top. Read
from the source (every import, lazy ones inside functions included), nothing is run."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "minisgl"

# package -> the minisgl packages / modules it may import (itself always)
ALLOWED = {
    "step": set(),
    "kernels": {"utils"},
    "kvcache": {"utils", "config"},
    "attention": {"step", "kernels", "kvcache", "config", "utils"},
    "models": {"config", "distributed", "kernels", "utils"},
}


def minisgl_imports(path: Path) -> set[str]:
    """The top-level minisgl packages a file imports (`minisgl.x.y` -> `x`)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "minisgl" and len(parts) > 1:
                found.add(parts[1])
    return found


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_a_low_layer_imports_nothing_above_it(package):
    files = sorted((SRC / package).rglob("*.py"))
    assert files, package
    wrong = {
        str(f.relative_to(SRC)): sorted(minisgl_imports(f) - ALLOWED[package] - {package})
        for f in files
    }
    assert {f: w for f, w in wrong.items() if w} == {}


def test_the_reader_sees_lazy_and_plain_imports(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import minisgl.engine.engine\nfrom minisgl.step.plan import StepPlan\n"
        "def f():\n    from minisgl.server import ipc\n    import os\n"
    )
    assert minisgl_imports(probe) == {"engine", "step", "server"}
