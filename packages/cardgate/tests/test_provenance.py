"""Issue 40, classes 2 and 3: the recorded commit holds the code that ran (every repo module
the tests imported is tracked, unmodified and inside the root), the run's environment is
recorded, and a red record proves a red state of the code its tests import."""

from __future__ import annotations

import json

import pytest
from cardgate_repo import FAIL, HOLD, PASS, USAGE, Repo, manifest_of, ready

CARD = "P0-007"
RED = "every-class-fails-on-the-gate-before-this-card"
GREEN = "every-class-refused-with-its-reason"
IMPORTS_IMPL = '__import__("impl").OK'

FAKE_IMPL = """\
import builtins
import types

_import = builtins.__import__


def _fake(name, *args, **kwargs):
    if name == "impl":
        return types.SimpleNamespace(OK=False)
    return _import(name, *args, **kwargs)


builtins.__import__ = _fake
"""


def _with_impl(repo: Repo, ok: str = "True") -> None:
    repo.card(tdd=False)
    repo.tests(impl=IMPORTS_IMPL, tdd=False)
    repo.write("src/impl.py", f"OK = {ok}\n")


@pytest.mark.card(
    CARD, "imported-repo-modules-are-tracked-unmodified-and-inside-the-root", RED, GREEN
)
def test_an_implementation_hidden_by_info_exclude_holds(repo: Repo) -> None:
    _with_impl(repo)
    (repo.path / ".git/info/exclude").write_text("src/impl.py\n")
    repo.commit("tests only: the implementation is excluded from git")
    assert repo.status() == ""
    result = repo.gate()
    # issue 61: the clean room holds the commit only: the excluded module is not there
    assert result.ret == FAIL, result.stdout.str()
    result.stdout.fnmatch_lines(["*FAIL*No module named 'impl'*"])


@pytest.mark.card(
    CARD, "imported-repo-modules-are-tracked-unmodified-and-inside-the-root", RED, GREEN
)
@pytest.mark.parametrize("flag", ["--skip-worktree", "--assume-unchanged"])
def test_a_module_hidden_from_git_status_holds(repo: Repo, flag: str) -> None:
    _with_impl(repo, ok="False")
    repo.commit("the committed implementation fails")
    repo.git("update-index", flag, "src/impl.py")
    repo.write("src/impl.py", "OK = True\n")
    assert repo.status() == ""
    result = repo.gate()
    # issue 61: the clean room runs the committed implementation, which fails
    assert result.ret == FAIL, result.stdout.str()
    result.stdout.fnmatch_lines(["*FAIL*child-one*assert*"])


@pytest.mark.card(
    CARD, "imported-repo-modules-are-tracked-unmodified-and-inside-the-root", RED, GREEN
)
def test_a_symlink_out_of_the_repo_holds(
    repo: Repo, tmp_path_factory: pytest.TempPathFactory
) -> None:
    outside = tmp_path_factory.mktemp("outside")
    (outside / "impl.py").write_text("OK = True\n")
    repo.card(tdd=False)
    repo.tests(impl=IMPORTS_IMPL, tdd=False)
    (repo.path / "src").mkdir()
    (repo.path / "src/impl.py").symlink_to(outside / "impl.py")
    repo.commit("the implementation lives outside the repository")
    result = repo.gate()
    assert result.ret == HOLD, result.stdout.str()
    result.stdout.fnmatch_lines(["*src/impl.py*outside the repository*"])


@pytest.mark.card(CARD, "tests-paths-outside-the-repository-are-refused", RED, GREEN)
def test_a_tests_header_outside_the_repo_is_a_usage_error(
    repo: Repo, tmp_path_factory: pytest.TempPathFactory
) -> None:
    outside = tmp_path_factory.mktemp("outside_tests")
    (outside / "test_far.py").write_text(
        'import pytest\n\n@pytest.mark.card("T-001", "child-one")\ndef test_far():\n    pass\n'
    )
    ready(repo)
    card = repo.path / "kanban/in-progress/T-001-demo.md"
    header = f"Depends on: none\nTests: {outside}"
    card.write_text(card.read_text().replace("Depends on: none", header))
    repo.commit("Tests: names a folder outside the repository")
    result = repo.gate()
    assert result.ret == USAGE, result.stdout.str() + result.stderr.str()
    assert "outside the repository" in result.stdout.str() + result.stderr.str()


@pytest.mark.card(CARD, "path-pythonpath-and-the-interpreter-are-recorded", RED, GREEN)
def test_the_environment_is_recorded_without_private_paths(
    repo: Repo, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(repo.path / "src"))
    ready(repo)
    assert repo.gate().ret == PASS
    manifest = manifest_of(repo.evidence()[-1])
    environment = manifest.get("environment", {})
    assert set(environment) >= {"python", "PATH", "PYTHONPATH", "sitecustomize"}
    assert environment["PYTHONPATH"] == ""  # the gate builds the environment (issue 61)
    assert "PYTHONPATH" in manifest["env_dropped"]
    assert str(repo.path) not in json.dumps(manifest)


@pytest.mark.card(CARD, "a-sitecustomize-on-the-path-is-recorded-and-refused", RED, GREEN)
def test_a_red_run_broken_by_a_sitecustomize_is_refused(
    repo: Repo, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    outside = tmp_path_factory.mktemp("site")
    (outside / "sitecustomize.py").write_text(FAKE_IMPL)
    repo.card()
    repo.tests(impl=IMPORTS_IMPL)
    repo.write("src/impl.py", "OK = True\n")  # implemented before any red run
    repo.commit("tests and implementation together")
    monkeypatch.setenv("PYTHONPATH", str(outside))
    red = repo.gate("--phase", "red")
    assert red.ret != PASS, red.stdout.str()
    # issue 61: the gate drops the inherited PYTHONPATH, so the sitecustomize never runs
    manifest = manifest_of(repo.evidence()[-1])
    assert "PYTHONPATH" in manifest["env_dropped"]
    assert not manifest["environment"].get("foreign_startup")


def _red_then(repo: Repo, impl: str) -> None:
    repo.card()
    repo.tests(impl=impl)
    repo.write("src/impl.py", "OK = False\n")
    repo.commit("red: failing tests")
    assert repo.gate("--phase", "red").ret == PASS


@pytest.mark.card(CARD, "bound-tests-changed-since-their-red-record-are-refused", RED, GREEN)
def test_a_bound_test_rewritten_after_its_red_record_holds(repo: Repo) -> None:
    _red_then(repo, IMPORTS_IMPL)
    tests = repo.path / "tests/test_demo.py"
    tests.write_text(tests.read_text().replace("    assert IMPL", "    assert True"))
    repo.write("src/impl.py", "OK = None\n")
    repo.commit("green?: the implementation 'changed' and the test asserts nothing")
    result = repo.gate()
    assert result.ret == HOLD, result.stdout.str()
    result.stdout.fnmatch_lines(["*tests/test_demo.py::test_one*changed since*red*"])
    allowed = repo.gate("--allow-changed-tests")
    assert allowed.ret == PASS, allowed.stdout.str()
    assert manifest_of(repo.evidence()[-1]).get("allow_changed_tests") is True


@pytest.mark.card(CARD, "implementation-means-files-the-bound-tests-import", RED, GREEN)
def test_a_change_to_a_file_no_test_imports_is_not_an_implementation(
    repo: Repo, monkeypatch: pytest.MonkeyPatch
) -> None:
    _red_then(repo, '__import__("pathlib").Path("go_green.txt").exists()')
    repo.write("go_green.txt", "a data file, not an import\n")
    repo.write("src/unused.py", "X = 1\n")
    repo.commit("only a data file and a module no test imports")
    result = repo.gate()
    assert result.ret == HOLD, result.stdout.str()
    result.stdout.fnmatch_lines(["*no file the bound tests import changed*"])
