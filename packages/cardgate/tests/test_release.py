"""A checklist item bound to a release-gate decision: `cardgate.release` reads the report JSON
(never raising), the `release_gate` fixture requires `promote` and records the decision, and
the card gate passes or fails the bound item on it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cardgate_repo import Repo

from cardgate.release import assert_release_json, check_release_json

PROMOTE = {"decision": "promote", "exit_code": 0, "reasons": ["every signal within policy"]}
ROLLBACK = {
    "decision": "rollback",
    "exit_code": 2,
    "reasons": ["rollback: output_mismatch [rust_service@cpu]: 1 of 8 compared output(s) differ"],
}


def write(tmp_path: Path, data: object, name: str = "r.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return path


def test_check_release_json(tmp_path: Path) -> None:
    ok = check_release_json(write(tmp_path, PROMOTE))
    assert ok.passed and ok.decision == "promote" and ok.code == 0 and ok.reasons == []
    bad = check_release_json(write(tmp_path, ROLLBACK))
    assert not bad.passed and bad.code == 2
    assert bad.reasons == ["decision is 'rollback', expected 'promote'", *ROLLBACK["reasons"]]
    hold = check_release_json(write(tmp_path, {"decision": "hold"}))
    assert not hold.passed and hold.code == 1
    with pytest.raises(AssertionError, match="release gate failed for .*output_mismatch"):
        assert_release_json(write(tmp_path, ROLLBACK))
    assert assert_release_json(write(tmp_path, PROMOTE)).decision == "promote"


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (None, "cannot read release-gate report"),
        ("{not json", "cannot read release-gate report"),
        ("[1, 2]", "not a JSON object"),
        ({"decision": "ship it"}, "decision is 'ship it'"),
        ({}, "decision is None"),
        ({"decision": "promote", "exit_code": 2}, "exit_code 2 disagrees"),
    ],
)
def test_bad_reports_fail_without_raising(tmp_path: Path, content: object, reason: str) -> None:
    path = tmp_path / "missing.json" if content is None else write(tmp_path, content)
    result = check_release_json(path)
    assert not result.passed and reason in result.reasons[0]


def test_release_gate_fixture_requires_promote_and_records_the_decision(repo: Repo) -> None:
    repo.card()
    repo.write("promote.json", json.dumps(PROMOTE))
    repo.write("rollback.json", json.dumps(ROLLBACK))
    repo.write(
        "tests/test_r.py",
        "import pytest\n\n"
        '@pytest.mark.card("T-001", "child two")\n'
        "def test_good(release_gate):\n    release_gate('promote.json')\n\n"
        "def test_bad(release_gate):\n    release_gate('rollback.json')\n",
    )
    result = repo.pytester.runpytest("--cardgate-report=r.json")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        ["*release gate failed for rollback.json: decision is 'rollback', expected 'promote'*"]
    )
    tests = json.loads((repo.path / "r.json").read_text())["tests"]
    metrics = {t["nodeid"].split("::")[-1]: t["metrics"] for t in tests if t["when"] == "teardown"}
    assert metrics["test_good"] == [
        {"name": "release_decision", "value": 0.0, "unit": "decision", "higher_is_better": False}
    ]
    assert metrics["test_bad"][0]["value"] == 2.0  # a rollback is recorded as evidence too
    good = next(t for t in tests if t["nodeid"].endswith("test_good") and t["when"] == "call")
    assert good["items"] == ["T-001::child-two"]


@pytest.mark.parametrize(("report", "ret", "status"), [(PROMOTE, 0, "pass"), (ROLLBACK, 1, "fail")])
def test_card_gate_on_a_release_decision(repo: Repo, report: dict, ret: int, status: str) -> None:
    repo.card(tdd=False)
    repo.write("worklog/baselines/release.json", json.dumps(report))
    repo.write(
        "tests/test_demo.py",
        "import pytest\n\n"
        '@pytest.mark.card("T-001", "child-one")\n'
        "def test_one():\n    pass\n\n"
        '@pytest.mark.card("T-001", "child two")\n'
        "def test_release(release_gate):\n"
        "    release_gate('worklog/baselines/release.json')\n",
    )
    repo.commit("release evidence")
    result = repo.gate("--dry-run", "--json")
    assert result.ret == ret, result.stdout.str()
    out = json.loads(result.stdout.str())
    items = {i["key"]: i["status"] for i in out["items"]}
    assert items["child-two"] == status and items["child-one"] == "pass"
