"""Issue 9: the gate cannot be fooled, never loses evidence, reports what it decided."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest
from cardgate_repo import Repo

from cardgate.preflight import card_lock

P = pytest.mark.card
PASS, FAIL, HOLD, USAGE = 0, 1, 2, 3
CARD = "kanban/in-progress/T-001-demo.md"


def _summary(record: Path) -> dict:
    return json.loads((record / "summary.json").read_text())


def _ready(repo: Repo, impl: str = "True", ops: float = 100.0) -> None:
    repo.card(tdd=False)
    repo.tests(impl=impl, tdd=False, ops=ops)
    repo.commit()


@P("P0-000", "hold-on-missing-evidence-nothing-moves")
def test_failing_bound_test_left_out_holds(repo: Repo) -> None:
    """Only a dry run may narrow the run (-k); a real gate refuses it (issue 61)."""
    _ready(repo, impl="False")
    result = repo.gate("--dry-run", "--", "-k", "not test_one")
    assert result.ret == HOLD, result.stdout.str()
    result.stdout.fnmatch_lines(["*child-one*bound test did not run*tests/test_demo.py::test_one*"])
    assert (repo.path / CARD).exists()
    for args in (("-k", "not test_one"), ("--deselect", "tests/test_demo.py::test_one")):
        assert repo.gate("--", *args).ret == USAGE


@P("P0-000", "hold-on-missing-evidence-nothing-moves")
def test_pytest_addopts_and_narrow_tests_header_cannot_hide_a_test(
    repo: Repo, monkeypatch: pytest.MonkeyPatch
) -> None:
    _ready(repo, impl="False")
    card = repo.path / CARD
    card.write_text(card.read_text().replace("Depends on: none", "Depends on: none\nTests: other"))
    repo.write("other/test_x.py", "def test_x():\n    pass\n")
    repo.commit("narrow Tests:")
    result = repo.gate()
    assert result.ret == FAIL, result.stdout.str()  # test_one ran although Tests: names other/
    monkeypatch.setenv("PYTEST_ADDOPTS", "-k test_two")
    result = repo.gate()
    assert result.ret == FAIL, result.stdout.str()  # the gate does not pass PYTEST_ADDOPTS on
    record = repo.evidence()[-1]
    manifest = json.loads((record / "manifest.json").read_text())
    assert "PYTEST_ADDOPTS" in manifest["env_dropped"]
    assert "tests/test_demo.py::test_one" in manifest["bound_tests"]["child-one"]


@P("P0-000", "metric-fixture-records-metrics")
def test_metric_recorded_twice_is_rejected(repo: Repo) -> None:
    _ready(repo)
    repo.write(
        "tests/test_dup.py",
        "import pytest\n\n@pytest.mark.bench\n@pytest.mark.card('T-001', 'child two')\n"
        "def test_again(metric):\n    metric('ops', 1.0)\n",
    )
    repo.commit()
    for workers in ((), ("-n", "2")):
        result = repo.gate(*workers)
        assert result.ret == FAIL, result.stdout.str()
        result.stdout.fnmatch_lines(["*FAIL  metric ops: recorded 2 times*"])
    twice = repo.path / "tests/test_dup.py"
    twice.write_text(
        twice.read_text().replace("metric('ops', 1.0)", "metric('x', 1)\n    metric('x', 2)")
    )
    repo.commit("twice in one test")
    result = repo.gate()
    assert result.ret == FAIL
    result.stdout.fnmatch_lines(["*metric 'x' recorded twice*"])


@P("P0-000", "duplicate-ids-status-vs-lane-unknown-dependencies")
def test_card_moved_to_done_by_hand_is_flagged(repo: Repo) -> None:
    repo.card(lane="done", tdd=False)
    repo.write(
        "kanban/todo/T-002.md",
        "# T-002: Dependent\nStatus: todo\nDepends on: T-001\n\n## Checklist\n- [ ] x\n",
    )
    repo.write(
        "tests/test_x.py",
        "import pytest\n\n@pytest.mark.card('T-002', 'x')\ndef test_x():\n    pass\n",
    )
    repo.commit()
    lint = repo.pytester.runpytest_subprocess("kanban", "-p", "no:randomly")
    lint.stdout.fnmatch_lines(["*T-001-demo.md:1: in done/ without a passing gate record*"])
    assert lint.ret == 1
    cli_lint = repo.cardgate("lint")
    assert cli_lint.ret == USAGE
    cli_lint.stdout.fnmatch_lines(
        ["*T-001-demo.md:1: in done/ without*", "2 cards, 0 lint errors, 1 flags"]
    )
    board = json.loads(repo.cardgate("board", "--json").stdout.str())
    row = {c["id"]: c for c in board["cards"]}
    assert row["T-001"]["verified"] is False and row["T-001"]["flags"]
    assert row["T-002"]["verified"] is None and row["T-002"]["last_gate"] is None
    gate = repo.cardgate("gate", "T-002")
    assert gate.ret == HOLD
    gate.stdout.fnmatch_lines(["*HOLD  depends on T-001: T-001: in done/ without a passing*"])


def _red_setup(repo: Repo) -> None:
    repo.card()
    repo.write("src/impl.py", "OK = False\n")
    repo.tests(impl='__import__("impl").OK')
    repo.commit("red")


@P("P0-000", "red-record-required-at-an-earlier-commit")
def test_hand_written_red_record_is_rejected(repo: Repo) -> None:
    _red_setup(repo)
    fake = repo.path / "worklog/evidence/T-001/20260101T000000Z-fake-red"
    fake.mkdir(parents=True)
    summary = {"phase": "red", "outcome": "pass", "commit": "HEAD~1", "card_id": "T-001",
               "red_failures": {"failing-test-first": ["tests/test_demo.py::test_one"]}}  # fmt: skip
    (fake / "summary.json").write_text(json.dumps(summary))
    repo.write("src/impl.py", "OK = True\n")
    repo.commit("impl")
    result = repo.gate()
    assert result.ret == HOLD, result.stdout.str()
    result.stdout.fnmatch_lines(
        ["*failing-test-first*no valid red record*not a record the gate wrote*"]
    )


@P("P0-000", "red-record-required-at-an-earlier-commit")
def test_red_by_env_then_empty_commit_is_rejected(
    repo: Repo, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo.card()
    repo.tests(impl='os.environ.get("IMPL") == "1"')
    repo.commit("red")
    assert repo.gate("--phase", "red").ret == PASS
    monkeypatch.setenv("IMPL", "1")
    repo.git("commit", "-q", "--allow-empty", "-m", "green?")
    result = repo.gate()
    assert result.ret == FAIL  # issue 61: the gate builds the environment; IMPL never arrives
    result.stdout.fnmatch_lines(["*FAIL*child-one*"])


def _red_run_with_test_one(repo: Repo, body: str) -> pytest.RunResult:
    """A red gate of the demo card whose bound `test_one` is `body`."""
    repo.card()
    repo.tests()
    test_file = repo.path / "tests/test_demo.py"
    text = test_file.read_text()
    start = text.index("def test_one")
    end = text.index("\n\n", start)
    test_file.write_text(text[:start] + body + text[end:])
    repo.commit("red")
    return repo.gate("--phase", "red")


@P("P0-000", "red-record-required-at-an-earlier-commit")
@pytest.mark.parametrize(
    "body",
    ["def test_one(missing_fixture):\n    pass", "def test_one():\n    undefined_name"],
)
def test_red_must_fail_by_assertion(repo: Repo, body: str) -> None:
    result = _red_run_with_test_one(repo, body)
    assert result.ret == FAIL, result.stdout.str()
    result.stdout.fnmatch_lines(["*red must fail by assertion*"])


@P("P0-000", "red-record-required-at-an-earlier-commit")
@pytest.mark.parametrize(
    "body",
    [
        "def test_one():\n    with pytest.raises(ValueError):\n        int('1')",
        "def test_one():\n    pytest.fail('the behaviour is not there yet')",
    ],
    ids=["did-not-raise", "pytest-fail"],
)
def test_a_pytest_check_that_fails_is_red_by_assertion(repo: Repo, body: str) -> None:
    """`pytest.raises` that sees nothing raised and `pytest.fail` are the test's own checks, as
    an assert is (they raise pytest's `Failed`, not AssertionError): a red they give is a red.
    Found gating P0-008's red phase: `DID NOT RAISE GateUsageError` was refused as an error."""
    result = _red_run_with_test_one(repo, body)
    assert result.ret == PASS, result.stdout.str()
    result.stdout.fnmatch_lines(["*failing-test-first*failing by assertion as expected*"])


@P("P0-000", "hold-on-missing-evidence-nothing-moves")
def test_other_cards_lint_errors_hold(repo: Repo) -> None:
    _ready(repo)
    repo.write(
        "kanban/todo/T-002.md",
        "# T-002: A\nStatus: todo\nDepends on: T-003\n\n## Checklist\n- [x] a (manual)\n",
    )
    repo.write(
        "kanban/todo/T-003.md",
        "# T-003: B\nStatus: todo\nDepends on: T-002\n\n## Checklist\n- [x] b (manual)\n",
    )
    repo.commit()
    result = repo.gate()
    assert result.ret == HOLD, result.stdout.str()
    result.stdout.fnmatch_lines(["*HOLD  board lint: *dependency cycle*"])
    assert "card and board lint clean" not in result.stdout.str()


@P("P0-000", "evidence-written-atomically-and-never-overwritten")
def test_second_gate_on_same_card_is_refused(repo: Repo) -> None:
    _ready(repo)
    with card_lock(repo.path.resolve(), "T-001"):
        result = repo.gate()
    assert result.ret == USAGE
    result.stderr.fnmatch_lines(["*another gate is running on T-001*"])
    assert "Traceback" not in result.stderr.str()
    assert repo.evidence() == []


@P("P0-000", "evidence-written-atomically-and-never-overwritten")
def test_same_name_already_in_done_is_an_error(repo: Repo) -> None:
    _ready(repo)
    repo.write(
        "kanban/done/T-001-demo.md",
        "# T-009: Other\nStatus: done\n\n## Checklist\n- [x] y (manual)\n",
    )
    repo.commit()
    before = repo.snapshot()
    result = repo.gate()
    assert result.ret == USAGE
    result.stderr.fnmatch_lines(["*kanban/done/T-001-demo.md already exists*"])
    assert repo.snapshot() == before


@P("P0-000", "evidence-written-atomically-and-never-overwritten")
def test_evidence_is_readable_relative_and_started_at_start(repo: Repo) -> None:
    repo.card(tdd=False)
    repo.tests(tdd=False)
    test_file = repo.path / "tests/test_demo.py"
    test_file.write_text(
        test_file.read_text().replace(
            "    assert IMPL", "    import time\n    time.sleep(1.5)\n    assert IMPL"
        )
    )
    repo.commit()
    os.umask(0o077)
    try:
        result = repo.gate()
    finally:
        os.umask(0o022)
    assert result.ret == PASS, result.stdout.str()
    (record,) = repo.evidence()
    for path in [record, *record.iterdir()]:
        assert stat.S_IMODE(path.stat().st_mode) & 0o044 == 0o044, path
    text = (record / "manifest.json").read_text()
    assert str(repo.path) not in text and os.path.expanduser("~") not in text
    manifest = json.loads(text)
    started = datetime.fromisoformat(manifest["started_utc"])
    finished = datetime.fromisoformat(manifest["finished_utc"])
    assert (finished - started).total_seconds() >= 1
    assert record.name.startswith(started.strftime("%Y%m%dT%H%M%SZ"))


@P("P0-000", "pass-ticks-boxes-appends-validation-and-moves-the-card")
def test_commit_flag_commits_card_and_evidence(repo: Repo, tmp_path: Path) -> None:
    _ready(repo)
    result = repo.gate("--commit")
    assert result.ret == PASS, result.stdout.str()
    assert repo.git("status", "--porcelain") == ""
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(repo.path), str(clone)], check=True)
    board = json.loads(repo.cardgate("board", "--json", "--root", str(clone)).stdout.str())
    (row,) = board["cards"]
    assert row["verified"] is True and row["flags"] == []
    assert (
        row["last_gate"]["outcome"] == "pass"
        and (clone / row["last_gate"]["evidence_dir"]).is_dir()
    )
    # a re-gate of a done card records fresh evidence and keeps it in done/
    again = repo.cardgate("gate", "T-001", "--commit")
    assert again.ret == PASS, again.stdout.str()
    assert len(repo.evidence()) == 2 and repo.git("status", "--porcelain") == ""
    card = (repo.path / "kanban/done/T-001-demo.md").read_text()
    assert card.count("## Validation (") == 1
    assert json.loads(repo.cardgate("board", "--json").stdout.str())["cards"][0]["verified"] is True


@P("P0-000", "fail-on-a-failed-test-or-missed-threshold-nothing-moves")
def test_hanging_test_times_out_as_fail(repo: Repo) -> None:
    repo.card(tdd=False)
    repo.tests(tdd=False)
    test_file = repo.path / "tests/test_demo.py"
    test_file.write_text(
        test_file.read_text().replace("    assert IMPL", "    __import__('time').sleep(60)")
    )
    repo.commit()
    result = repo.gate("--timeout", "1")
    assert result.ret == FAIL, result.stdout.str()
    result.stdout.fnmatch_lines(["*FAIL*child-one*timeout*longer than 1s*"])
    card = repo.path / CARD
    card.write_text(card.read_text().replace("Depends on: none", "Depends on: none\nTimeout: 1"))
    repo.commit("card timeout")
    assert repo.gate().ret == FAIL


@P("P0-000", "distinct-exit-codes-for-pass-fail-hold-and-usage-errors")
def test_exit_codes_json_and_help(repo: Repo) -> None:
    _ready(repo, impl="False")
    bad = repo.gate("--phase", "blue")
    assert bad.ret == USAGE
    bad.stderr.fnmatch_lines(["cardgate: decision=usage exit=3"])
    usage = repo.pytester.run(sys.executable, "-m", "cardgate", "gate", "--help")
    usage.stdout.fnmatch_lines(
        ["*exit codes: 0 pass, 1 fail, 2 hold*", "*after `--` go to pytest*"]
    )
    result = repo.gate("--json")
    assert result.ret == FAIL
    data = json.loads(result.stdout.str())
    assert data["decision"] == "fail" and data["exit_code"] == 1
    result.stderr.fnmatch_lines(["cardgate: decision=fail exit=1"])


@P("P0-000", "board-as-a-table-json-and-markdown")
def test_report_shows_text_tests_and_marker_hint(repo: Repo) -> None:
    repo.card(tdd=False)
    repo.tests(tdd=False)
    test_file = repo.path / "tests/test_demo.py"
    test_file.write_text(test_file.read_text().replace('"child two"', '"child one"'))
    repo.commit()
    result = repo.gate()
    assert result.ret == HOLD
    result.stdout.fnmatch_lines(
        [
            "*HOLD  parent-thing:*children satisfied (child-two: hold)*",
            "*HOLD*child-two: unbound*",
            "*text: child two",
            '*bind a test: @pytest.mark.card("T-001", "child-two")',
            "totals: 4 items: 2 pass, 2 hold, 0 fail",
            "*ticked box counts only for (manual) items*",
        ]
    )
