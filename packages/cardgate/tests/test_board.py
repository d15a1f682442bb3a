from __future__ import annotations

import json

import pytest
from cardgate_repo import Repo

from cardgate.board import load_board
from cardgate.scan import bindings_in_source

P = pytest.mark.card


def _card(card_id: str, status: str, depends: str = "none") -> str:
    return f"# {card_id}: Card\nStatus: {status}\nDepends on: {depends}\n\n## Checklist\n- [ ] x\n"


@P("P0-000", "duplicate-ids-status-vs-lane-unknown-dependencies")
def test_board_lint_rules(repo: Repo) -> None:
    repo.write("kanban/todo/A-001.md", _card("A-001", "todo"))
    repo.write("kanban/done/A-001-copy.md", _card("A-001", "done"))
    repo.write("kanban/in-progress/A-002.md", _card("A-002", "done", "A-003"))
    repo.write("kanban/todo/A-003.md", _card("A-003", "todo", "A-002, A-404"))
    repo.write("kanban/doing/A-004.md", _card("A-004", "todo"))
    board = load_board(repo.path)
    found = [str(e) for e in board.errors]
    assert "kanban/todo/A-003.md:3: 'Depends on' names unknown card A-404" in found
    assert "kanban/done/A-001-copy.md:1: duplicate card id A-001 (also kanban/todo/A-001.md:1)" in (
        found
    )
    assert "kanban/todo/A-001.md:1: duplicate card id A-001 (also kanban/done/A-001-copy.md:1)" in (
        found
    )
    assert (
        "kanban/in-progress/A-002.md:2: Status 'done' disagrees with lane folder 'in-progress'"
        in found
    )
    assert any("dependency cycle" in e for e in found)
    assert any(e.startswith("kanban/doing/A-004.md:0: card outside the lanes") for e in found)
    result = repo.cardgate("lint")
    assert result.ret == 3


@P("P0-000", "duplicate-ids-status-vs-lane-unknown-dependencies")
def test_clean_board_lints_clean(repo: Repo) -> None:
    repo.card()
    assert load_board(repo.path).errors == []
    assert repo.cardgate("lint").ret == 0


@P("P0-000", "pytest-kanban-lints-every-card")
def test_pytest_collects_cards_as_lint_items(repo: Repo) -> None:
    repo.card()
    repo.write("kanban/todo/B-001.md", _card("B-001", "done", "B-999") + "- [] broken\n")
    repo.write("kanban/README.md", "not a card\n")
    result = repo.pytester.runpytest("kanban")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*kanban/todo/B-001.md:2: Status 'done' disagrees with lane folder 'todo'*",
            "*kanban/todo/B-001.md:3: 'Depends on' names unknown card B-999*",
            "*kanban/todo/B-001.md:7: unparseable checkbox line*",
        ]
    )


@P("P0-000", "board-as-a-table-json-and-markdown")
def test_board_views(repo: Repo) -> None:
    repo.card()
    repo.tests()
    table = repo.cardgate("board")
    assert table.ret == 0
    table.stdout.fnmatch_lines(["Lane*Card*Prio*Depends on*Bound*Unbound*Last gate*", "*T-001*"])
    data = json.loads(repo.cardgate("board", "--json").stdout.str())
    (row,) = data["cards"]
    # leaves: child-one, child-two, looked-at-it (manual), failing-test-first, passes-now
    assert (row["id"], row["bound"], row["unbound"], row["manual"]) == ("T-001", 4, 0, 1)
    assert row["last_gate"] is None
    markdown = repo.cardgate("board", "--markdown").stdout.str()
    assert "| Lane | Card |" in markdown and "| in-progress | T-001 |" in markdown


@P("P0-000", "board-as-a-table-json-and-markdown")
def test_static_binding_scan_follows_aliases() -> None:
    source = (
        "import pytest\nfrom pytest import mark\nC = pytest.mark.card\n"
        "pytestmark = pytest.mark.card('A-001', 'one')\n"
        "@C('A-001', 'two', 'three')\ndef test_a(): pass\n"
        "@mark.card('A-002', 'four')\ndef test_b(): pass\n"
        "@pytest.mark.card(CARD, 'dynamic')\ndef test_c(): pass\n"
    )
    assert bindings_in_source(source) == [
        ("A-001", "one"),
        ("A-001", "two"),
        ("A-001", "three"),
        ("A-002", "four"),
    ]
    assert bindings_in_source("def broken(:\n") == []
