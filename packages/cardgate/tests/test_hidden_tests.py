"""Issue 40, class 6: the gate runs every test a static scan finds bound to the card, whatever
addopts, conftest `collect_ignore` or `testpaths` say."""

from __future__ import annotations

import pytest
from cardgate_repo import FAIL, IN_PROGRESS_CARD, Repo, ready

CARD = "P0-007"
RED = "every-class-fails-on-the-gate-before-this-card"
GREEN = "every-class-refused-with-its-reason"

HIDDEN = """\
import pytest

@pytest.mark.card("T-001", "child-one")
def test_hidden():
    assert False, "the hidden failure"
"""


@pytest.mark.card(CARD, "every-statically-bound-test-is-collected", RED, GREEN)
@pytest.mark.parametrize("how", ["addopts --ignore", "collect_ignore", "outside testpaths"])
def test_a_hidden_failing_bound_test_fails_the_gate(repo: Repo, how: str) -> None:
    ready(repo)
    path = "other/test_hidden.py" if how == "outside testpaths" else "tests/test_hidden.py"
    repo.write(path, HIDDEN)
    if how == "addopts --ignore":
        repo.write(
            "pyproject.toml",
            '[tool.pytest.ini_options]\ntestpaths = ["tests"]\npythonpath = ["src"]\n'
            'addopts = "--ignore=tests/test_hidden.py"\n',
        )
    elif how == "collect_ignore":
        repo.write("tests/conftest.py", 'collect_ignore = ["test_hidden.py"]\n')
    repo.commit(f"a failing bound test hidden by {how}")
    result = repo.gate()
    assert result.ret == FAIL, result.stdout.str()
    result.stdout.fnmatch_lines(["*child-one*test_hidden*"])
    assert (repo.path / IN_PROGRESS_CARD).exists()
