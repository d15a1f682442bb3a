"""Issue 40, class 5: a TDD phase heading the parser does not know is a lint error, never a
silently dropped Red requirement; `(manual)` counts only as a trailing marker."""

from __future__ import annotations

import pytest

from cardgate.card import parse_card

CARD = "P0-007"
RED = "every-class-fails-on-the-gate-before-this-card"
GREEN = "every-class-refused-with-its-reason"

TEXT = """\
# T-001: Demo
Status: todo
Depends on: none

## Checklist
- [ ] a thing

## TDD Subtasks
{heading}
- [ ] failing test first
"""


@pytest.mark.card(CARD, "phase-like-headings-the-parser-does-not-know-are-lint-errors", RED, GREEN)
@pytest.mark.parametrize(
    "heading", ["🔴 Red", "Red:", "**Red**", "1 - Red", "Step 1: Red", "### Redd", "Phase A"]
)
def test_an_unknown_phase_heading_is_an_error_or_a_red_phase(heading: str) -> None:
    result = parse_card(TEXT.format(heading=heading), "kanban/todo/T-001.md")
    assert result.card is not None
    red = [item.key for item in result.card.red_items()]
    errors = [str(e) for e in result.errors]
    assert red == ["failing-test-first"] or any(":9:" in e for e in errors), (red, errors)


@pytest.mark.card(CARD, "manual-only-as-a-trailing-marker", RED, GREEN)
def test_manual_counts_only_as_a_trailing_marker() -> None:
    text = (
        "# T-001: Demo\nStatus: todo\nDepends on: none\n\n## Checklist\n"
        "- [ ] The (manual) override path is tested\n"
        "- [ ] Looked at the plots (manual)\n"
        "- [ ] Read it (Manual)  \n"
    )
    result = parse_card(text, "kanban/todo/T-001.md")
    assert result.card is not None
    manual = {item.key: item.manual for item in result.card.items.values()}
    assert manual == {
        "the-manual-override-path-is-tested": False,
        "looked-at-the-plots": True,
        "read-it": True,
    }
