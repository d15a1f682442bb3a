"""Issue 61, "a stranger's re-run" (card P0-008): `cardgate verify --rerun ID` re-runs a done
card's green gate in a clean room of the commit its newest green record names, writes nothing
into the repository, and exits 0 only when the decision and every item agree with the record."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from cardgate_repo import PASS, USAGE, Repo

CARD = "P0-008"
RED = "every-mechanism-fails-on-the-gate-before-this-card"
GREEN = "every-mechanism-refused-with-its-reason"
DISAGREE = 1

OUTSIDE_TESTS = """\
import pathlib

import pytest

FLAG = pathlib.Path({flag!r})


@pytest.mark.card("T-001", "child-one")
def test_one():
    assert FLAG.exists(), "the result depends on a file outside the commit"


@pytest.mark.card("T-001", "child two")
def test_two():
    pass
"""


def _out(result: pytest.RunResult) -> str:
    return result.stdout.str() + result.stderr.str()


def _done(repo: Repo, flag: Path | None = None, *gate_args: str) -> str:
    """A card gated to done (committed, with `gate_args`); its first test needs `flag` when one
    is given."""
    repo.card(tdd=False)
    if flag is None:
        repo.write("tests/test_demo.py", OUTSIDE_TESTS.format(flag="/"))
    else:
        repo.write("tests/test_demo.py", OUTSIDE_TESTS.format(flag=str(flag)))
    commit = repo.commit("a card whose tests pass")
    result = repo.gate("--commit", *gate_args)
    assert result.ret == PASS, _out(result)
    return commit


@pytest.mark.card(CARD, RED, GREEN)
def test_a_rerun_of_a_done_card_agrees_and_writes_nothing(repo: Repo) -> None:
    commit = _done(repo)
    repo.tests(impl="False", tdd=False)  # HEAD moves on; the re-run is of the recorded commit
    repo.commit("later work breaks the test")
    before, head = repo.snapshot(), repo.git("rev-parse", "HEAD")
    result = repo.cardgate("verify", "--rerun", "T-001")
    assert result.ret == PASS, _out(result)
    assert commit[:10] in _out(result)
    assert "agree" in _out(result)
    assert repo.snapshot() == before, "the re-run wrote into the repository"
    assert repo.git("rev-parse", "HEAD") == head and repo.status() == ""
    assert len(repo.evidence()) == 1


@pytest.mark.card(CARD, RED, GREEN)
def test_a_rerun_that_reaches_another_decision_exits_1_with_a_diff(repo: Repo) -> None:
    flag = repo.path.parent / "outside-flag"
    flag.write_text("the gate's machine had this file\n")
    _done(repo, flag)
    flag.unlink()  # a stranger's machine does not
    result = repo.cardgate("verify", "--rerun", "T-001")
    assert result.ret == DISAGREE, _out(result)
    out = _out(result)
    assert "outcome: recorded pass, re-run fail" in out, out
    assert "child-one: recorded pass, re-run fail" in out, out
    assert "child-two: recorded" not in out, out  # only what differs


@pytest.mark.card(CARD, RED, GREEN)
def test_a_rerun_needs_a_done_card_with_a_green_record(repo: Repo) -> None:
    repo.card(tdd=False)
    repo.tests(tdd=False)
    repo.commit()
    result = repo.cardgate("verify", "--rerun", "T-001")
    assert result.ret == USAGE, _out(result)
    assert "not done/" in _out(result), _out(result)
    repo.card(lane="done", tdd=False)  # moved by hand: no record
    repo.git("rm", "-q", "kanban/in-progress/T-001-demo.md")
    repo.commit("moved to done by hand")
    result = repo.cardgate("verify", "--rerun", "T-001")
    assert result.ret == USAGE, _out(result)
    assert "no passing green record" in _out(result), _out(result)


@pytest.mark.card(CARD, RED, GREEN)
def test_the_room_leaves_a_virtualenv_inside_the_working_tree_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`nox` keeps its virtualenvs in the checkout (`.nox/`): their site-packages are the
    interpreter's, not the commit's; moved into the room (which has no `.nox/`), pytest lost
    every installed plugin, cardgate's own included (`unrecognized arguments: --cardgate-card`),
    and no real card could be gated or re-run."""
    from cardgate import roomplugin

    tree, room = tmp_path / "tree", tmp_path / "room"
    venv = tree / ".nox" / "tests"
    site = venv / "lib" / "site-packages"
    for folder in (site, tree / "src", room / "src"):
        folder.mkdir(parents=True)
    monkeypatch.setattr(sys, "prefix", str(venv))
    monkeypatch.setattr(sys, "exec_prefix", str(venv))
    monkeypatch.setattr(sys, "path", [str(site), str(tree / "src")])
    roomplugin.redirect(tree.resolve(), room.resolve())
    assert sys.path == [str(site), str((room / "src").resolve())]


# The gate that decided a record is the commit's own (its noxfile, its cardgate, its runtime and
# Rust binary); today's gate judging an old commit mixes two versions of the rules and the code
# (a re-run of P0-007 at fd2eb16 failed 8 of its 42 tests: today's cardgate plugin loaded beside
# the commit's cardgate modules). The repository names how its gate is run; the clone runs it.
RUNGATE = """\
import os
import pathlib
import sys

pathlib.Path({probe!r}).write_text(os.getcwd() + "\\n" + " ".join(sys.argv[1:]))
os.execv(sys.executable, [sys.executable, "-m", "cardgate", "gate", *sys.argv[1:]])
"""
RERUN_CONFIG = '\n[tool.cardgate]\nrerun = ["{python}", "rungate.py"]\n'


@pytest.mark.card(CARD, RED, GREEN)
def test_the_rerun_runs_the_commits_own_gate_as_the_repository_names_it(repo: Repo) -> None:
    probe = repo.path.parent / "rerun-probe.txt"
    pyproject = repo.path / "pyproject.toml"
    pyproject.write_text(pyproject.read_text() + RERUN_CONFIG)
    repo.write("rungate.py", RUNGATE.format(probe=str(probe)))
    commit = _done(
        repo, None, "--", "-q"
    )  # the caller's pytest arguments, recorded in the manifest
    repo.write("rungate.py", "import sys\n\nsys.exit('a later gate that breaks')\n")
    repo.commit("HEAD's gate is broken: the re-run runs the commit's")
    before = repo.snapshot()
    result = repo.cardgate("verify", "--rerun", "T-001")
    out = _out(result)
    assert result.ret == PASS, out
    assert commit[:10] in out and "agree" in out, out
    assert probe.exists(), "the re-run did not run the commit's own gate"
    cwd, argv = probe.read_text().split("\n")
    assert Path(cwd).resolve() != repo.path.resolve(), "the re-run ran in the repository"
    assert argv.split()[:4] == ["T-001", "--phase", "green", "--dry-run"], argv
    # the recorded gate's pytest arguments go with it (P1-012's record ran --run-suite-check:
    # without it its re-run held a deselected bound test)
    assert argv.split()[-1] == "-q", argv
    assert repo.snapshot() == before and len(repo.evidence()) == 1


@pytest.mark.card(CARD, RED, GREEN)
def test_a_rerun_whose_own_gate_cannot_start_is_a_disagreement(repo: Repo) -> None:
    pyproject = repo.path / "pyproject.toml"
    pyproject.write_text(pyproject.read_text() + RERUN_CONFIG)
    repo.write("rungate.py", "import sys\n\nsys.exit('no gate here')\n")
    _done(repo)
    result = repo.cardgate("verify", "--rerun", "T-001")
    out = _out(result)
    assert result.ret == DISAGREE, out
    assert "outcome: recorded pass, re-run absent" in out, out
    assert "no gate here" in out, out


# Re-running P0-007 through nox: the gate writes its JSON (over 8 KiB: straight through the
# buffer) and its newline (buffered until exit) to stdout, its summary to stderr, and nox merges
# the two: the JSON's last line came as "}cardgate: decision=pass exit=0", and a passing re-run
# read as "no decision printed". This gate does the same on one stream, and half the JSON
# before its stderr line on two.
SPLIT_GATE = """\
import subprocess
import sys

done = subprocess.run([sys.executable, "-m", "cardgate", "gate", *sys.argv[1:]],
                      capture_output=True, text=True)
body = done.stdout.rstrip("\\n")
sys.stdout.write(body[: len(body) // 2])
sys.stdout.flush()
sys.stderr.write(done.stderr + "a stderr line written while the JSON is half printed\\n")
sys.stderr.flush()
sys.stdout.write(body[len(body) // 2 :] + "cardgate: decision=pass exit=0 (merged as nox does)\\n")
sys.exit(done.returncode)
"""


@pytest.mark.card(CARD, RED, GREEN)
def test_the_gates_json_is_read_whatever_follows_it_on_its_last_line(repo: Repo) -> None:
    pyproject = repo.path / "pyproject.toml"
    pyproject.write_text(pyproject.read_text() + RERUN_CONFIG)
    repo.write("rungate.py", SPLIT_GATE)
    _done(repo)
    result = repo.cardgate("verify", "--rerun", "T-001")
    out = _out(result)
    assert result.ret == PASS and "agree" in out, out


@pytest.mark.card(CARD, RED, GREEN)
def test_the_rerun_environment_keeps_installers_variables_and_adds_no_build_folder() -> None:
    """The commit's build decides where its outputs go: a shared CARGO_TARGET_DIR set by the
    re-run moved P1-011's binary away from the `rust/target/release/` its noxfile copies from
    (FileNotFoundError, no decision). Inherited installer settings pass; PYTHONPATH does not."""
    from cardgate.rerun import rerun_env

    env = rerun_env({"PATH": "/bin", "HOME": "/h", "PIP_INDEX_URL": "https://mirror/simple",
                     "PYTHONPATH": "/elsewhere", "CARGO_HOME": "/c"})  # fmt: skip
    assert "CARGO_TARGET_DIR" not in env
    assert env["PIP_INDEX_URL"] == "https://mirror/simple" and env["CARGO_HOME"] == "/c"
    assert "PYTHONPATH" not in env and env["PATH"] == "/bin"
    assert rerun_env({"PATH": "/bin", "CARGO_TARGET_DIR": "/t"})["CARGO_TARGET_DIR"] == "/t"
