"""Issue 61, part B: the card grammar is closed. ASCII card ids, phase headings from a closed
list, no ticked manual Red item, no invisible characters and no checkbox inside a quote; every
such line is a lint error with its line, never silently read as prose."""

from __future__ import annotations

import pytest

from cardgate.card import parse_card

CARD = "P0-009"
RED = "every-mechanism-fails-on-the-gate-before-this-card"
GREEN = "every-mechanism-refused-with-its-reason"

TDD = """\
# T-001: Demo
Status: todo
Depends on: none

## Checklist
- [ ] a thing

## TDD Subtasks
{heading}
- [ ] failing test first
"""


def _lines(text: str) -> list[int]:
    return [e.line for e in parse_card(text, "kanban/todo/T-001.md").errors]


@pytest.mark.card(CARD, "ascii-card-ids-only", RED, GREEN)
@pytest.mark.parametrize("dep", ["P0-00\u0661", "P0-\uff10\uff10\uff11", "P\u0660-001"])
def test_a_unicode_digit_in_depends_on_is_an_error_never_a_dependency(dep: str) -> None:
    result = parse_card(f"# T-001: x\nStatus: todo\nDepends on: {dep}\n", "c.md")
    assert result.card is not None
    assert result.card.depends_on == []
    assert [e.line for e in result.errors] == [3], result.errors


@pytest.mark.card(CARD, "ascii-card-ids-only", RED, GREEN)
def test_a_unicode_digit_in_the_card_id_is_an_error() -> None:
    result = parse_card("# P0-00\u0663: x\nStatus: todo\n", "c.md")
    assert [e.line for e in result.errors] == [1], result.errors


@pytest.mark.card(CARD, "phase-headings-from-a-closed-grammar", RED, GREEN)
@pytest.mark.parametrize(
    "heading",
    ["Red phase", "I. Red", "<h3>Red</h3>", "**Red**", "Red", "1. Red phase", "### Red tests"],
)
def test_phase_like_lines_outside_the_grammar_are_errors(heading: str) -> None:
    result = parse_card(TDD.format(heading=heading), "c.md")
    assert result.card is not None
    assert 9 in [e.line for e in result.errors], (heading, result.errors)


@pytest.mark.card(CARD, "phase-headings-from-a-closed-grammar", RED, GREEN)
@pytest.mark.parametrize("heading", ["1. Red", "2) Red", "### Red", "1. Red (failing first)"])
def test_the_closed_grammar_reads_red(heading: str) -> None:
    result = parse_card(TDD.format(heading=heading), "c.md")
    assert result.errors == []
    assert result.card is not None
    assert [i.key for i in result.card.red_items()] == ["failing-test-first"]


@pytest.mark.card(CARD, "phase-headings-from-a-closed-grammar", RED, GREEN)
def test_prose_that_mentions_red_stays_prose() -> None:
    text = TDD.format(heading="No red records: the recorder is this card's own deliverable.")
    assert _lines(text) == []


@pytest.mark.card(CARD, "a-ticked-manual-item-under-red-is-an-error", RED, GREEN)
def test_a_ticked_manual_red_item_is_an_error() -> None:
    text = TDD.format(heading="1. Red").replace(
        "- [ ] failing test first", "- [ ] failing test first\n- [x] looked red to me (manual)"
    )
    assert _lines(text) == [11]


@pytest.mark.card(CARD, "invisible-characters-and-quoted-checkboxes-are-errors", RED, GREEN)
@pytest.mark.parametrize(
    "line",
    [
        "\u200b- [ ] hidden behind a zero-width space",
        "- [ ] a\u200bthing with a zero-width space",
        "- [ ] right-to-left \u202eoverride",
        "- [ ] isolate \u2066here\u2069",
        "\ufeff- [ ] a BOM mid-file",
        "- [ ] soft\u00adhyphen",
    ],
)
def test_invisible_characters_are_errors(line: str) -> None:
    text = f"# T-001: x\nStatus: todo\n\n## Checklist\n- [ ] visible\n{line}\n"
    assert 6 in _lines(text), repr(line)


@pytest.mark.card(CARD, "invisible-characters-and-quoted-checkboxes-are-errors", RED, GREEN)
def test_a_leading_bom_is_not_an_error() -> None:
    assert _lines("\ufeff# T-001: x\nStatus: todo\n\n## Checklist\n- [ ] visible\n") == []


@pytest.mark.card(CARD, "invisible-characters-and-quoted-checkboxes-are-errors", RED, GREEN)
@pytest.mark.parametrize("line", ["> - [ ] quoted", ">- [x] quoted", "> > * [ ] nested quote"])
def test_a_checkbox_inside_a_quote_is_an_error(line: str) -> None:
    text = f"# T-001: x\nStatus: todo\n\n## Checklist\n- [ ] visible\n{line}\n"
    assert _lines(text) == [6]
