"""Issue 61, "red pinned to the test side" (card P0-008): a red record keeps the digests of the
test-side files that ran (the bound test modules and every conftest.py on their paths); the
green gate refuses a red record when such a file changed since in a way that changes what the
bound test checks: a module-level name the test reads, a conftest fixture it uses, a new
autouse fixture. A change beside the test (another test, an unused fixture) still counts."""

from __future__ import annotations

import hashlib
import json

import pytest
from cardgate_repo import HOLD, PASS, Repo

CARD = "P0-008"
RED = "every-mechanism-fails-on-the-gate-before-this-card"
GREEN = "every-mechanism-refused-with-its-reason"

TEST = """\
import impl
import pytest

EXPECTED = {expected}


@pytest.mark.card("T-001", "child-one", "failing-test-first", "passes now")
def test_one({args}):
    assert impl.VALUE == {compared}


@pytest.mark.card("T-001", "child two")
def test_two():
    pass
{more}"""

CONFTEST = """\
import impl
import pytest


@pytest.fixture
def setting():
    return {setting}
{more}"""

AUTOUSE = """

@pytest.fixture(autouse=True)
def _force(monkeypatch):
    monkeypatch.setattr(impl, "VALUE", 1)
"""

UNUSED = """

@pytest.fixture
def unused():
    return 99
"""

ANOTHER_TEST = """

def test_three():
    pass
"""


def _test(expected: int = 1, args: str = "", compared: str = "EXPECTED", more: str = "") -> str:
    return TEST.format(expected=expected, args=args, compared=compared, more=more)


def _out(result: pytest.RunResult) -> str:
    return result.stdout.str() + result.stderr.str()


def _red_then_green(repo: Repo, red: dict[str, str], green: dict[str, str]) -> pytest.RunResult:
    repo.card(lane="todo")
    repo.write("src/impl.py", "VALUE = 0\n")
    for path, text in red.items():
        repo.write(path, text)
    repo.commit("red: the bound test fails")
    result = repo.gate("--phase", "red")
    assert result.ret == PASS, _out(result)
    for path, text in green.items():
        repo.write(path, text)
    repo.commit("green")
    (repo.path / "kanban/done").rmdir()  # git keeps no empty lane folders
    return repo.gate()


CHANGES = {
    "a module constant the test reads": (
        {"tests/test_demo.py": _test(expected=1)},
        {"tests/test_demo.py": _test(expected=2), "src/impl.py": "VALUE = 2\n"},
        "tests/test_demo.py",
    ),
    "a conftest fixture the test uses": (
        {
            "tests/test_demo.py": _test(args="setting", compared="setting"),
            "tests/conftest.py": CONFTEST.format(setting=1, more=""),
        },
        {"tests/conftest.py": CONFTEST.format(setting=2, more=""), "src/impl.py": "VALUE = 2\n"},
        "tests/conftest.py",
    ),
    "a new autouse conftest fixture": (
        {
            "tests/test_demo.py": _test(expected=1),
            "tests/conftest.py": CONFTEST.format(setting=1, more=""),
        },
        {
            "tests/conftest.py": CONFTEST.format(setting=1, more=AUTOUSE),
            "src/impl.py": "VALUE = 0  # refactored\n",
        },
        "tests/conftest.py",
    ),
}


@pytest.mark.card(CARD, RED, GREEN)
@pytest.mark.parametrize("how", list(CHANGES))
def test_a_test_side_change_after_red_refuses_the_red_record(repo: Repo, how: str) -> None:
    red, green, named = CHANGES[how]
    result = _red_then_green(repo, red, green)
    assert result.ret == HOLD, _out(result)
    result.stdout.fnmatch_lines([f"*HOLD*failing-test-first*no valid red record*{named}*"])
    assert (repo.path / "kanban/todo/T-001-demo.md").exists()


@pytest.mark.card(CARD, GREEN)
def test_a_change_beside_the_test_keeps_the_red_record(repo: Repo) -> None:
    conftest = CONFTEST.format(setting=1, more="")
    result = _red_then_green(
        repo,
        {"tests/test_demo.py": _test(expected=1), "tests/conftest.py": conftest},
        {
            "tests/test_demo.py": _test(expected=1, more=ANOTHER_TEST),
            "tests/conftest.py": CONFTEST.format(setting=1, more=UNUSED),
            "src/impl.py": "VALUE = 1\n",
        },
    )
    assert result.ret == PASS, _out(result)
    red = next(r for r in repo.evidence() if r.name.endswith("-red"))
    pinned = json.loads((red / "manifest.json").read_text()).get("test_side_files")
    assert pinned == {
        "tests/conftest.py": hashlib.sha256(conftest.encode()).hexdigest(),
        "tests/test_demo.py": hashlib.sha256(_test(expected=1).encode()).hexdigest(),
    }
