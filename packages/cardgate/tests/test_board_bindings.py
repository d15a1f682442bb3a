"""Issue 40: the board counts a card's bindings the way the gate finds them (constants,
module `pytestmark`, aliases), and agrees with every done card's green evidence here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cardgate_repo import Repo

from cardgate import evidence
from cardgate.board import board_json

CARD = "P0-007"
RED = "every-class-fails-on-the-gate-before-this-card"
GREEN = "every-class-refused-with-its-reason"
ROOT = Path(__file__).resolve().parents[3]

BOUND_BY_NAMES = """\
import pytest

CARD_ID = "T-001"
ITEM = "child two"
BOTH = ("child-one", "child two")
P = pytest.mark.card
pytestmark = pytest.mark.card(CARD_ID, "child one")


@P(CARD_ID, ITEM)
def test_a():
    pass


@pytest.mark.card(CARD_ID, *BOTH)
def test_b():
    pass
"""


def _row(root: Path, card_id: str) -> dict:
    return next(r for r in board_json(root)["cards"] if r["id"] == card_id)


@pytest.mark.card(CARD, "the-board-counts-bindings-as-the-gate-finds-them", RED, GREEN)
def test_the_board_resolves_constants_aliases_and_pytestmark(repo: Repo) -> None:
    repo.card(tdd=False)
    repo.write("tests/test_names.py", BOUND_BY_NAMES)
    row = _row(repo.path, "T-001")
    assert (row["bound"], row["unbound"], row["manual"]) == (2, 0, 1)


def _green_bound_keys(card_id: str) -> set[str]:
    passing = [
        r
        for r in evidence.records(ROOT, card_id)
        if r.phase == "green" and r.outcome == "pass" and r.intact
    ]
    if not passing:
        return set()
    manifest = json.loads((passing[-1].path / "manifest.json").read_text(encoding="utf-8"))
    return {k for k, nodes in manifest.get("bound_tests", {}).items() if nodes}


@pytest.mark.card(CARD, "the-board-counts-bindings-as-the-gate-finds-them", RED, GREEN)
def test_the_board_agrees_with_the_green_evidence_of_every_done_card() -> None:
    disagree = {}
    for row in board_json(ROOT)["cards"]:
        if row["lane"] != "done":
            continue
        from_gate = _green_bound_keys(row["id"])
        if from_gate and row["unbound"]:
            disagree[row["id"]] = (row["bound"], row["unbound"], sorted(from_gate)[:3])
    assert disagree == {}
