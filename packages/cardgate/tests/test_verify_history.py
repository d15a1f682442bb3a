"""Issue 40, class 4: a done card is verified only by a passing record on the current
history, and only while no later gate of the same card text failed."""

from __future__ import annotations

import shutil
from datetime import datetime, timedelta

import pytest
from cardgate_repo import FAIL, PASS, Repo

from cardgate import evidence
from cardgate.board import load_board
from cardgate.verify import verify_card

CARD = "P0-007"
RED = "every-class-fails-on-the-gate-before-this-card"
GREEN = "every-class-refused-with-its-reason"


def _verification(repo: Repo):  # type: ignore[no-untyped-def]
    board = load_board(repo.path)
    return verify_card(repo.path, board.cards["T-001"])


@pytest.mark.card(CARD, "a-passing-record-off-the-current-history-does-not-verify", RED, GREEN)
def test_a_record_copied_from_a_side_branch_does_not_verify(repo: Repo) -> None:
    repo.card(tdd=False)
    repo.tests(impl="False", tdd=False)
    repo.commit("main: the tests fail")
    repo.git("checkout", "-q", "-b", "side")
    repo.tests(impl="True", tdd=False)
    repo.commit("side: the tests pass")
    assert repo.gate("--commit").ret == PASS
    repo.git("checkout", "-q", "main")
    repo.git("checkout", "side", "--", "kanban/done", "worklog/evidence")
    repo.git("rm", "-q", "kanban/in-progress/T-001-demo.md")
    repo.commit("the done card and its evidence copied from the side branch")
    verification = _verification(repo)
    assert verification.verified is False
    assert any("not an ancestor" in flag for flag in verification.flags), verification.flags
    lint = repo.cardgate("lint")
    assert lint.ret != 0


@pytest.mark.card(CARD, "a-later-failing-gate-of-the-same-card-text-un-verifies", RED, GREEN)
def test_a_later_failing_gate_un_verifies_a_done_card(repo: Repo) -> None:
    repo.card(tdd=False)
    repo.tests(impl="True", tdd=False)
    repo.commit()
    assert repo.gate("--commit").ret == PASS
    assert _verification(repo).verified is True
    repo.tests(impl="False", tdd=False)
    repo.commit("break it")
    assert repo.gate().ret == FAIL  # re-gated in place, same card text
    verification = _verification(repo)
    assert verification.verified is False
    assert any("failed" in flag for flag in verification.flags), verification.flags


@pytest.mark.card(CARD, "a-later-failing-gate-of-the-same-card-text-un-verifies", RED, GREEN)
def test_a_later_failing_gate_in_the_same_second_un_verifies_whatever_its_folder_name(
    repo: Repo,
) -> None:
    """Two gates in one second share their folders' stamp, so the folder names order them by
    their commits' short hashes; the later failing gate must still count as later (by the
    microsecond stamp in its summary). Here its folder's hash sorts first on purpose."""
    repo.card(tdd=False)
    repo.tests(impl="True", tdd=False)
    repo.commit()
    assert repo.gate("--commit").ret == PASS
    repo.tests(impl="False", tdd=False)
    repo.commit("break it")
    assert repo.gate().ret == FAIL
    base = repo.path / evidence.EVIDENCE_ROOT / "T-001"
    passed, failed = (r for r in evidence.records(repo.path, "T-001"))
    assert (passed.outcome, failed.outcome) == ("pass", "fail")
    stamp = passed.path.name.split("-")[0]
    moved = base / f"{stamp}-0000000-green"
    shutil.copytree(failed.path, moved)
    shutil.rmtree(failed.path)
    later = datetime.fromisoformat(passed.summary["started_utc"]) + timedelta(microseconds=1)
    summary = {k: v for k, v in failed.summary.items() if k != "digest"}
    (moved / evidence.SUMMARY).unlink()
    evidence.write_summary(moved, {**summary, "started_utc": later.isoformat()})
    ordered = evidence.records(repo.path, "T-001")
    assert [r.outcome for r in ordered] == ["pass", "fail"], [r.path.name for r in ordered]
    assert ordered[-1].path.name < ordered[0].path.name  # the folder names say the opposite
    verification = _verification(repo)
    assert verification.verified is False
    assert any("failed" in flag for flag in verification.flags), verification.flags
