"""Issue 9 case 1 and 5 (headings): nothing on a card is silently ignored."""

from __future__ import annotations

import textwrap

import pytest
from cardgate_repo import Repo

from cardgate.card import parse_card, phase_of

P = pytest.mark.card
HOLD, USAGE = 2, 3


def _errors(text: str) -> list[tuple[int, str]]:
    return [(e.line, e.message) for e in parse_card(textwrap.dedent(text), "c.md").errors]


@P("P0-000", "malformed-input-reported-with-file-and-line")
@pytest.mark.parametrize(
    "heading", ["## Check list", "## Acceptance criteria:", "### Checklist", "## TDD subtask"]
)
def test_near_miss_item_sections_are_lint_errors(heading: str) -> None:
    errors = _errors(f"# T-001: x\nStatus: todo\n\n{heading}\n- [ ] lost item\n")
    assert [line for line, _ in errors][:1] == [4], errors
    assert "## " in errors[0][1]


@P("P0-000", "malformed-input-reported-with-file-and-line")
def test_checkboxes_outside_item_sections_and_unknown_fields() -> None:
    errors = _errors(
        """\
        # T-001: x
        Status: todo
        Dependencies: T-002
        Gate: worklog/gates/T-001.yaml
        - [ ] in the header

        ## Objective
        * [x] in the objective
        1. [ ] numbered in the objective

        ## Checklist
        - [ ] fine
        """
    )
    assert [line for line, _ in errors] == [3, 4, 5, 8, 9]
    assert "unknown header field 'Dependencies': did you mean 'Depends on:'?" in errors[0][1]
    assert "unknown header field 'Gate'" in errors[1][1]
    assert all("outside an item section" in m for _, m in errors[2:])


@P("P0-000", "malformed-input-reported-with-file-and-line")
@pytest.mark.parametrize(
    "heading", ["1. **Red**", "### 1. Red", "### Phase 1: Red", "### 🔴 Red", "1) 🔴 *Red*:"]
)
def test_red_headings_however_written(heading: str) -> None:
    result = parse_card(
        f"# T-001: x\nStatus: todo\n\n## TDD Subtasks\n{heading}\n- [ ] fails first\n", "c.md"
    )
    assert result.errors == []
    assert result.card is not None and [i.key for i in result.card.red_items()] == ["fails-first"]
    assert phase_of(heading.lstrip("#")) == "red"


@P("P0-000", "malformed-input-reported-with-file-and-line")
def test_unrecognised_tdd_heading_is_an_error() -> None:
    errors = _errors("# T-001: x\nStatus: todo\n\n## TDD Subtasks\n### 1. Rde\n- [ ] x\n")
    assert errors and errors[0][0] == 5 and "unrecognised TDD phase heading" in errors[0][1]


@P("P0-000", "malformed-input-reported-with-file-and-line")
def test_gates_file_under_another_name_is_a_lint_error(repo: Repo) -> None:
    repo.card(tdd=False)
    repo.write("worklog/gates/T-001.yml", "gates: []\n")
    result = repo.cardgate("lint")
    assert result.ret == USAGE
    result.stdout.fnmatch_lines(["*kanban/in-progress/T-001-demo.md:*T-001.yml*Gates:*"])


@P("P0-000", "hold-on-missing-evidence-nothing-moves")
def test_card_without_items_never_passes(repo: Repo) -> None:
    repo.write("kanban/in-progress/T-001-demo.md", "# T-001: Empty\nStatus: in-progress\n")
    repo.write("tests/test_x.py", "def test_x():\n    pass\n")
    repo.commit()
    result = repo.gate()
    assert result.ret == HOLD, result.stdout.str()
    result.stdout.fnmatch_lines(["*card has no items*"])
    assert (repo.path / "kanban/in-progress/T-001-demo.md").exists()


@P("P0-000", "hold-on-missing-evidence-nothing-moves")
def test_near_miss_card_holds_the_gate_with_usage(repo: Repo) -> None:
    repo.write(
        "kanban/in-progress/T-001-demo.md",
        "# T-001: Near miss\nStatus: in-progress\n\n## Check list\n- [ ] child one\n",
    )
    repo.write("tests/test_x.py", "def test_x():\n    pass\n")
    repo.commit()
    result = repo.gate()
    assert result.ret == USAGE
    result.stderr.fnmatch_lines(["*T-001-demo.md:4: section '## Check list'*"])
    assert (repo.path / "kanban/in-progress/T-001-demo.md").exists()
