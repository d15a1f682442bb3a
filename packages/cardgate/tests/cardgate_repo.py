"""Helpers shared by the cardgate tests (a module with a unique name, importable from tests)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

CARD = """\
# T-001: Demo card
Priority: P0
Status: {status}
Depends on: {depends}

## Checklist
- [ ] Parent thing:
  - [ ] child one
  - [ ] child two
- [x] Looked at it (manual)
{tdd}
## Progress Notes (2026-01-01)
- not an item
"""

TDD = """
## TDD Subtasks
1. Red
- [ ] failing test first
2. Green
- [ ] passes now
"""

TESTS = """\
import os
import pytest

IMPL = {impl}

@pytest.mark.card("T-001", {one_items})
def test_one():
    assert IMPL

@pytest.mark.card("T-001", "child two")
@pytest.mark.bench
def test_two(metric):
    metric("ops", {ops}, unit="ops/s")
    metric("base_ops", 10.0, unit="ops/s")

def test_unrelated():
    pass
"""


class Repo:
    """A throwaway git repository with a kanban board, driven through the real CLI."""

    def __init__(self, pytester: pytest.Pytester) -> None:
        self.pytester = pytester
        self.path = pytester.path
        for lane in ("todo", "in-progress", "done", "backlog"):
            (self.path / "kanban" / lane).mkdir(parents=True, exist_ok=True)
        self.write(
            "pyproject.toml",
            '[tool.pytest.ini_options]\ntestpaths = ["tests"]\npythonpath = ["src"]\n',
        )
        self.write(".gitignore", "__pycache__/\n.hypothesis/\n/stdout\n/stderr\n")
        self.git("init", "-q", "-b", "main")
        self.git("config", "user.email", "gate@example.invalid")
        self.git("config", "user.name", "gate")
        self.git("config", "commit.gpgsign", "false")

    def write(self, rel: str, text: str) -> Path:
        path = self.path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
        return path

    def card(self, lane: str = "in-progress", depends: str = "none", tdd: bool = True) -> Path:
        text = CARD.format(status=lane, depends=depends, tdd=TDD if tdd else "")
        return self.write(f"kanban/{lane}/T-001-demo.md", text)

    def tests(self, impl: str = "True", ops: float = 100.0, tdd: bool = True) -> Path:
        items = '"child-one", "failing-test-first", "passes now"' if tdd else '"child-one"'
        text = TESTS.format(impl=impl, ops=ops, one_items=items)
        return self.write("tests/test_demo.py", text)

    def git(self, *args: str) -> str:
        proc = subprocess.run(
            ["git", *args], cwd=self.path, capture_output=True, text=True, check=True
        )
        return proc.stdout.strip()

    def status(self) -> str:
        """`git status` without the gate's own evidence directory."""
        return self.git("status", "--porcelain", "--", ".", ":(exclude)worklog/evidence")

    def commit(self, message: str = "wip") -> str:
        self.git("add", "-A")
        self.git("commit", "-q", "-m", message)
        return self.git("rev-parse", "HEAD")

    def cardgate(self, *args: str) -> pytest.RunResult:
        return self._run("-m", "cardgate", *args, "--root", str(self.path))

    def gate(self, *args: str) -> pytest.RunResult:
        return self._run("-m", "cardgate", "gate", "T-001", "--root", str(self.path), *args)

    def _run(self, *args: str) -> pytest.RunResult:
        """The CLI in a subprocess. Its pytest runs load no installed plugin but cardgate (and
        xdist, which the gate names with -n): autoloading hypothesis, schemathesis, anyio...
        costs ~2 s a pytest process and the throwaway repos use none of them."""
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
            return self.pytester.run(sys.executable, *args)

    def evidence(self) -> list[Path]:
        base = self.path / "worklog" / "evidence" / "T-001"
        return sorted(base.iterdir()) if base.is_dir() else []

    def snapshot(self) -> dict[str, bytes]:
        skip = {".git", "__pycache__", ".hypothesis", "stdout", "stderr"}  # last two: pytester
        return {
            p.relative_to(self.path).as_posix(): p.read_bytes()
            for p in sorted(self.path.rglob("*"))
            if p.is_file() and not skip.intersection(p.relative_to(self.path).parts)
        }


PASS, FAIL, HOLD, USAGE = 0, 1, 2, 3
IN_PROGRESS_CARD = "kanban/in-progress/T-001-demo.md"


def ready(repo: Repo, impl: str = "True", ops: float = 100.0) -> str:
    """A committed card without TDD phases and its tests (test_one asserts `impl`)."""
    repo.card(tdd=False)
    repo.tests(impl=impl, tdd=False, ops=ops)
    return repo.commit()


def summary_of(record: Path) -> dict:
    import json

    return json.loads((record / "summary.json").read_text())


def manifest_of(record: Path) -> dict:
    import json

    return json.loads((record / "manifest.json").read_text())
