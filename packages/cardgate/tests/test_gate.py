from __future__ import annotations

import json
from pathlib import Path

import pytest
from cardgate_repo import Repo

from cardgate.evidence import create_record_dir, write_new

P = pytest.mark.card
PASS, FAIL, HOLD, USAGE = 0, 1, 2, 3


def _summary(record: Path) -> dict:
    return json.loads((record / "summary.json").read_text())


def _items(record: Path) -> dict[str, str]:
    return {i["key"]: i["status"] for i in _summary(record)["items"]}


@P("P0-000", "full-loop-from-the-command-line-red-green-pass-card-moved")
@P("P0-000", "pass-ticks-boxes-appends-validation-and-moves-the-card")
@P("P0-000", "red-record-required-at-an-earlier-commit")
def test_full_loop_red_then_green_then_pass(repo: Repo, monkeypatch: pytest.MonkeyPatch) -> None:
    repo.card(lane="todo")
    repo.write("src/impl.py", "OK = False\n")
    repo.tests(impl='__import__("impl").OK')
    red_commit = repo.commit("red: failing tests")

    red = repo.gate("--phase", "red")
    assert red.ret == PASS, red.stdout.str()
    red.stdout.fnmatch_lines(["*failing-test-first: tests/test_demo.py::test_one*"])
    (red_dir,) = repo.evidence()
    assert red_dir.name.endswith(f"-{red_commit[:7]}-red")
    assert _summary(red_dir)["red_failures"] == {
        "failing-test-first": ["tests/test_demo.py::test_one"]
    }

    repo.write("src/impl.py", "OK = True\n")
    same_commit = repo.gate()
    # the clean room runs the commit, not the edited file: its test still fails (round 4); the
    # edit only holds the clean-tree check
    assert same_commit.ret == FAIL, same_commit.stdout.str()
    same_commit.stdout.fnmatch_lines(
        ["*FAIL*[[]green[]] passes-now*assert False*", "*HOLD*clean tree*src/impl.py*"]
    )

    repo.commit("green: the implementation")
    green_commit = repo.git("rev-parse", "HEAD")
    (repo.path / "kanban/done").rmdir()  # git keeps no empty lane folders
    result = repo.gate("-n", "2")
    assert result.ret == PASS, result.stdout.str()
    result.stdout.fnmatch_lines(["decision: PASS (exit 0)", "moved to: kanban/done/T-001-demo.md*"])

    assert not (repo.path / "kanban/todo/T-001-demo.md").exists()
    card = (repo.path / "kanban/done/T-001-demo.md").read_text()
    assert "Status: done" in card and "- [ ]" not in card.split("## Progress Notes")[0]
    assert "- not an item" in card  # progress notes are never touched
    record = repo.evidence()[-1]
    rel = record.relative_to(repo.path).as_posix()
    assert f"Commit: `{green_commit}`" in card and f"Evidence: `{rel}/`" in card
    assert "## Validation (" in card
    staged = repo.git("status", "--porcelain")
    assert "kanban/done/T-001-demo.md" in staged and "kanban/todo/T-001-demo.md" in staged
    assert sorted(p.name for p in record.iterdir()) == [
        "manifest.json", "metrics.json", "report.jsonl", "summary.json",
    ]  # fmt: skip
    manifest = json.loads((record / "manifest.json").read_text())
    assert manifest["commit"] == green_commit and manifest["dirty"] is False
    assert (
        manifest["card_path"] == "kanban/todo/T-001-demo.md" and len(manifest["card_sha256"]) == 64
    )
    assert {"python", "cpu_model", "versions", "env", "hardware"} <= set(manifest)
    assert str(repo.path) not in (record / "manifest.json").read_text()
    lines = [json.loads(x) for x in (record / "report.jsonl").read_text().splitlines()]
    assert {(x["nodeid"], x["when"]) for x in lines} >= {("tests/test_demo.py::test_one", "call")}
    metrics = json.loads((record / "metrics.json").read_text())
    assert metrics["metrics"] == {"ops": 100.0, "base_ops": 10.0}


@P("P0-000", "hold-on-missing-evidence-nothing-moves")
def test_hold_on_unbound_item_and_nothing_moves(repo: Repo) -> None:
    repo.card(tdd=False)
    repo.tests(tdd=False)
    test_file = repo.path / "tests/test_demo.py"
    test_file.write_text(test_file.read_text().replace('"child two"', '"child one"'))
    repo.commit()
    before = (repo.path / "kanban/in-progress/T-001-demo.md").read_bytes()
    result = repo.gate()
    assert result.ret == HOLD
    result.stdout.fnmatch_lines(
        ["*HOLD*child-two: unbound: no test is bound to this item*", "decision: HOLD (exit 2)"]
    )
    assert (repo.path / "kanban/in-progress/T-001-demo.md").read_bytes() == before
    assert repo.status() == ""
    (record,) = repo.evidence()
    assert _summary(record)["outcome"] == "hold"
    assert _items(record)["parent-thing"] == "hold"


@P("P0-000", "hold-on-missing-evidence-nothing-moves")
@P("P0-000", "gpu-tests-skip-without-cuda-as-missing-evidence")
def test_hold_on_skipped_gpu_test_dirty_tree_and_open_dependency(repo: Repo) -> None:
    repo.card(tdd=False, depends="T-002")
    repo.write("kanban/todo/T-002.md", "# T-002: Dep\nStatus: todo\n\n## Checklist\n- [ ] x\n")
    repo.tests(tdd=False)
    repo.write(
        "tests/test_gpu.py",
        "import pytest\n\n@pytest.mark.gpu\n@pytest.mark.card('T-001', 'child-two')\n"
        "def test_cuda():\n    pass\n",
    )
    repo.commit()
    repo.write("untracked.txt", "dirty")
    result = repo.gate()
    assert result.ret == HOLD
    result.stdout.fnmatch_lines(
        [
            "*HOLD*child-two:*skipped: gpu: no CUDA device*",
            "*HOLD  clean tree: dirty working tree: untracked.txt*",
            "*HOLD  depends on T-002: T-002 is in todo/*",
        ]
    )
    assert (repo.path / "kanban/in-progress/T-001-demo.md").exists()


@P("P0-000", "fail-on-a-failed-test-or-missed-threshold-nothing-moves")
def test_fail_on_failing_test(repo: Repo) -> None:
    repo.card(tdd=False)
    repo.tests(impl="False", tdd=False)
    repo.commit()
    result = repo.gate()
    assert result.ret == FAIL
    result.stdout.fnmatch_lines(["*FAIL*child-one: tests/test_demo.py::test_one call: *assert*"])
    assert (repo.path / "kanban/in-progress/T-001-demo.md").exists()
    assert repo.status() == ""


@P("P0-000", "fail-on-a-failed-test-or-missed-threshold-nothing-moves")
@P("P0-000", "absolute-and-relative-thresholds-with-noise-floor")
def test_benchmark_gates_decide(repo: Repo) -> None:
    repo.card(tdd=False)
    repo.tests(tdd=False, ops=95.0)
    repo.write(
        "worklog/gates/T-001.yaml",
        """\
        version: 1
        gates:
          - metric: ops
            relative: {baseline: base_ops, factor: 10, noise_floor: 0.1}
          - metric: ops
            hardware: "*H100*"
            min: 1000000
        """,
    )
    repo.commit()
    assert repo.gate().ret == PASS  # 95 >= 10 x 10 x 0.9; the H100 rule does not apply
    # the evidence names the gates file by its repo-relative path, never the checkout's own
    files = [p for p in (repo.path / "worklog/evidence").rglob("*") if p.is_file()]
    assert files and not [p.name for p in files if str(repo.path) in p.read_text()]
    assert "worklog/gates/T-001.yaml#0" in (files[0].parent / "summary.json").read_text()

    repo.git("reset", "-q", "--hard", "HEAD")  # undo the staged move to done/
    card = repo.path / "kanban/in-progress/T-001-demo.md"
    assert card.exists()
    repo.tests(tdd=False, ops=80.0)
    repo.commit("slower")
    result = repo.gate()
    assert result.ret == FAIL
    result.stdout.fnmatch_lines(
        ["*FAIL*child-two:*gate: ops=80 >= 90 (missed by 10)*", "*FAIL  gate ops relative*"]
    )
    assert card.exists()

    repo.write("worklog/gates/T-001.yaml", "gates:\n  - metric: not_recorded\n    min: 1\n")
    repo.commit("gate on a metric nobody records")
    missing = repo.gate()
    assert missing.ret == HOLD
    missing.stdout.fnmatch_lines(["*HOLD  gate not_recorded min: *was not recorded*"])


@P("P0-000", "dry-run-changes-nothing")
def test_dry_run_changes_nothing(repo: Repo) -> None:
    repo.card(tdd=False)
    repo.tests(tdd=False)
    repo.commit()
    before = repo.snapshot()
    result = repo.gate("--dry-run")
    assert result.ret == PASS
    result.stdout.fnmatch_lines(["decision: PASS (exit 0)", "evidence: (dry run: nothing written)"])
    assert repo.snapshot() == before
    assert repo.status() == ""


@P("P0-000", "evidence-written-atomically-and-never-overwritten")
def test_evidence_is_never_overwritten(repo: Repo, tmp_path: Path) -> None:
    target = tmp_path / "a.json"
    write_new(target, b"first")
    with pytest.raises(FileExistsError):
        write_new(target, b"second")
    assert target.read_bytes() == b"first"
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]  # no temp file left behind
    first = create_record_dir(tmp_path, "X-001", "abc1234", "green")
    second = create_record_dir(tmp_path, "X-001", "abc1234", "green")
    assert first != second and first.is_dir() and second.is_dir()

    repo.card(tdd=False)
    repo.tests(impl="False", tdd=False)
    repo.commit()
    assert repo.gate().ret == FAIL
    (record,) = repo.evidence()
    saved = {p.name: p.read_bytes() for p in record.iterdir()}
    assert repo.gate().ret == FAIL  # evidence of the first run does not dirty the tree
    assert len(repo.evidence()) == 2
    assert {p.name: p.read_bytes() for p in record.iterdir()} == saved


@P("P0-000", "distinct-exit-codes-for-pass-fail-hold-and-usage-errors")
def test_usage_errors_exit_3(repo: Repo) -> None:
    repo.card(tdd=False)
    repo.tests(tdd=False)
    repo.commit()
    unknown = repo.cardgate("gate", "T-404")
    assert unknown.ret == USAGE
    unknown.stderr.fnmatch_lines(["*unknown card 'T-404'*"])
    no_red = repo.gate("--phase", "red")
    assert no_red.ret == USAGE
    card = repo.path / "kanban/in-progress/T-001-demo.md"
    card.write_text(card.read_text() + "\n## Checklist\n- [] broken\n")
    lint = repo.gate()
    assert lint.ret == USAGE
    lint.stderr.fnmatch_lines(["*kanban/in-progress/T-001-demo.md:*unparseable checkbox line*"])
    assert repo.evidence() == []


SECOND_TEST = """\
import pytest

@pytest.mark.card("T-001", "second-failing-test")
def test_second():
    assert __import__("impl2").OK
"""


def _add_second_red_subtask(repo: Repo) -> None:
    card = repo.path / "kanban/in-progress/T-001-demo.md"
    text = card.read_text().replace(
        "- [ ] failing test first\n", "- [ ] failing test first\n- [ ] second failing test\n"
    )
    card.write_text(text)
    repo.write("src/impl2.py", "OK = False\n")
    repo.write("tests/test_second.py", SECOND_TEST)


@P("P0-000", "red-record-required-at-an-earlier-commit")
def test_a_later_red_subtask_gets_its_own_red_record(repo: Repo) -> None:
    """A card grows a second Red subtask after the first is implemented: its red run judges
    only Red items without a red record yet (the first one's tests pass by now, as they
    should), so it passes, and the green gate finds a red record for both."""
    repo.card()
    repo.write("src/impl.py", "OK = False\n")
    repo.tests(impl='__import__("impl").OK')
    repo.commit("red: failing tests")
    assert repo.gate("--phase", "red").ret == PASS
    repo.write("src/impl.py", "OK = True\n")
    repo.commit("green: the implementation")
    _add_second_red_subtask(repo)
    repo.commit("red: a second failing test")

    red = repo.gate("--phase", "red")
    assert red.ret == PASS, red.stdout.str()
    red.stdout.fnmatch_lines(["*PASS*failing-test-first*red record at*"])
    second = repo.evidence()[-1]
    assert _items(second)["second-failing-test"] == "pass"
    assert _summary(second)["outcome"] == "pass"

    repo.write("src/impl2.py", "OK = True\n")
    repo.commit("green: the second implementation")
    green = repo.gate("-n", "2")
    green.stdout.fnmatch_lines(["*PASS*?red] second-failing-test*red at*"])
    green.stdout.fnmatch_lines(["*PASS*?red] failing-test-first*red at*"])


@P("P0-000", "red-record-required-at-an-earlier-commit")
def test_a_red_item_keeps_its_red_record_from_a_run_that_failed_elsewhere(repo: Repo) -> None:
    """A red run where one Red item fails by assertion as expected and another is not red
    (its tests pass before the implementation): the run fails, yet the first item's red
    result is evidence of its own; the other item has none."""
    repo.card()
    repo.write("src/impl.py", "OK = False\n")
    repo.tests(impl='__import__("impl").OK')
    _add_second_red_subtask(repo)
    repo.write("src/impl2.py", "OK = True\n")  # not red: passes before any implementation
    repo.commit("red: failing tests")
    red = repo.gate("--phase", "red")
    assert red.ret == FAIL
    record = repo.evidence()[-1]
    assert _items(record) == {"failing-test-first": "pass", "second-failing-test": "fail"}

    repo.write("src/impl.py", "OK = True\n")
    repo.commit("green: the implementation")
    green = repo.gate("-n", "2")
    assert green.ret == HOLD
    green.stdout.fnmatch_lines(["*PASS*?red] failing-test-first*red at*"])
    green.stdout.fnmatch_lines(["*HOLD*?red] second-failing-test*no valid red record*"])
