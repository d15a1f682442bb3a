"""Issue 61, "bindings at collection" (card P0-008): every test function a static scan of the
committed tree finds bound to the card must have run; one pytest did not collect or run (a
later `def` of the same name, a conftest hook that deselects it before the gate's plugin sees
it, a hidden ini that changes `python_functions`) fails its item, naming the test."""

from __future__ import annotations

import pytest
from cardgate_repo import FAIL, HOLD, PASS, Repo

CARD = "P0-008"
RED = "every-mechanism-fails-on-the-gate-before-this-card"
GREEN = "every-mechanism-refused-with-its-reason"

BOUND = """\
import pytest


@pytest.mark.card("T-001", "child-one")
def test_one():
    assert False, "the bound test fails"


@pytest.mark.card("T-001", "child-one")
def test_also_one():
    pass


@pytest.mark.card("T-001", "child two")
def test_two():
    pass
"""

SHADOW = """

@pytest.mark.card("T-001", "child-one")
def test_one():  # same name: the module attribute is this one, the failing one never runs
    pass
"""

DESELECT = """\
import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    items[:] = [i for i in items if i.name != "test_one"]
"""

HIDDEN_INI = """\
[pytest]
testpaths = tests
pythonpath = src
python_functions = test_also_* test_two
"""


def _out(result: pytest.RunResult) -> str:
    return result.stdout.str() + result.stderr.str()


def _committed(repo: Repo, how: str) -> None:
    repo.card(tdd=False)
    repo.write("tests/test_demo.py", BOUND + (SHADOW if how == "shadowed" else ""))
    if how == "deselected by a conftest":
        repo.write("tests/conftest.py", DESELECT)
    elif how == "hidden ini":
        repo.write(".pytest.ini", HIDDEN_INI)
    repo.commit(f"a failing bound test that does not run: {how}")


@pytest.mark.card(CARD, RED, GREEN)
@pytest.mark.parametrize("how", ["shadowed", "deselected by a conftest", "hidden ini"])
def test_a_statically_bound_test_that_did_not_run_fails_its_item(repo: Repo, how: str) -> None:
    _committed(repo, how)
    result = repo.gate()
    assert result.ret == FAIL, _out(result)
    result.stdout.fnmatch_lines(["*FAIL*child-one*tests/test_demo.py::test_one*did not run*"])


@pytest.mark.card(CARD, GREEN)
def test_k_on_a_dry_run_still_holds(repo: Repo) -> None:
    _committed(repo, "none")
    result = repo.gate("--dry-run", "--", "-k", "not test_one")
    assert result.ret == HOLD, _out(result)


CLASSES_AND_PARAMS = """\
import functools

import pytest

pytestmark = pytest.mark.card("T-001", "child two")


def wrapped(func):
    @functools.wraps(func)
    def inner(*args, **kwargs):
        return func(*args, **kwargs)

    return inner


@pytest.mark.card("T-001", "child-one")
@pytest.mark.parametrize("n", [1, 2])
@wrapped
def test_one(n):
    assert n


@pytest.mark.card("T-001", "child-one")
class TestGroup:
    def test_in_class(self):
        pass

    class TestNested:
        def test_nested(self):
            pass

    def helper(self):
        pass


def test_module_marked():
    pass
"""


@pytest.mark.card(CARD, GREEN)
def test_parametrized_decorated_class_and_module_bindings_all_count_as_run(repo: Repo) -> None:
    repo.card(tdd=False)
    repo.write("tests/test_demo.py", CLASSES_AND_PARAMS)
    repo.commit("bindings of every shape")
    result = repo.gate("--dry-run")
    assert result.ret == PASS, _out(result)
