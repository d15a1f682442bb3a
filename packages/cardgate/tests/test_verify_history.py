"""Issue 40, class 4: a done card is verified only by a passing record on the current
history, and only while no later gate of the same card text failed."""

from __future__ import annotations

import pytest
from cardgate_repo import FAIL, PASS, Repo

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
