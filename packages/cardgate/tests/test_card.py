from __future__ import annotations

import textwrap

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cardgate.card import item_key, parse_card, slugify

P = pytest.mark.card

ISSUE_EXAMPLE = textwrap.dedent(
    """\
    # P0-003: Radix cache core in Rust
    Priority: P0
    STATUS: in-progress
    depends ON: P0-002, P0-001

    ## Objective
    Free text.
    - [ ] not an item (objective)

    ## Checklist
    - [ ] Arena-allocated radix tree:
      - [ ] page-aligned match and insert
      - [ ] LRU eviction of unlocked leaves
    - [x] `MINISGL_CPU_BACKEND=python|rust_hotpath` switch (manual)

    ## TDD Subtasks
    1. Red
    - [ ] Failing equivalence tests against the Python reference.
    2. Green
    - [ ] Implementation passes them.
    3. Refactor
    - [ ] One call per scheduler step.

    ## Acceptance Criteria
    - [ ] Token parity between backends.
    - [ ] Rust path >= 10x Python reference on the radix microbenchmark.

    ## Progress Notes (2026-02-14)
    Free text, never parsed for items.
    - [ ] Token parity between backends.
    """
)


@P("P0-000", "card-format-with-nested-items-and-slug-keys")
def test_issue_example_parses() -> None:
    result = parse_card(ISSUE_EXAMPLE, "kanban/todo/P0-003.md")
    # checkbox lines outside the item sections are never gated, so they are lint errors
    assert [(e.line, e.message.split(",")[0]) for e in result.errors] == [
        (8, "checkbox line in section 'objective'"),
        (30, "checkbox line in section 'progress notes'"),
    ]
    card = result.card
    assert card is not None
    assert (card.id, card.title, card.priority, card.status) == (
        "P0-003",
        "Radix cache core in Rust",
        "P0",
        "in-progress",
    )
    assert card.depends_on == ["P0-002", "P0-001"]
    assert list(card.items) == [
        "arena-allocated-radix-tree",
        "page-aligned-match-and-insert",
        "lru-eviction-of-unlocked-leaves",
        "minisgl-cpu-backend-python-rust-hotpath-switch",
        "failing-equivalence-tests-against-the-python-reference",
        "implementation-passes-them",
        "one-call-per-scheduler-step",
        "token-parity-between-backends",
        "rust-path-10x-python-reference-on-the-radix-microbenchmark",
    ]
    tree = card.items["arena-allocated-radix-tree"]
    assert tree.children == ["page-aligned-match-and-insert", "lru-eviction-of-unlocked-leaves"]
    assert card.items["lru-eviction-of-unlocked-leaves"].parent == tree.key
    switch = card.items["minisgl-cpu-backend-python-rust-hotpath-switch"]
    assert switch.manual and switch.checked and switch.line == 14
    assert [i.key for i in card.red_items()] == [
        "failing-equivalence-tests-against-the-python-reference"
    ]
    assert card.items["one-call-per-scheduler-step"].phase == "refactor"
    assert "progress notes" in card.sections and "objective" in card.sections
    # lookup by key, exact text and text with the (manual) marker
    assert (
        card.lookup("page-aligned match and insert") is card.items["page-aligned-match-and-insert"]
    )
    assert card.lookup(switch.text) is switch


@P("P0-000", "card-format-with-nested-items-and-slug-keys")
def test_slugs_are_stable() -> None:
    assert slugify("Page-aligned match & insert!") == "page-aligned-match-insert"
    assert slugify("Ünïcode  —  ok") == "unicode-ok"
    assert item_key("Docs reviewed (manual)") == item_key("Docs reviewed")


def _errors(text: str) -> list[tuple[int, str]]:
    return [(e.line, e.message) for e in parse_card(textwrap.dedent(text), "c.md").errors]


@P("P0-000", "malformed-input-reported-with-file-and-line")
def test_malformed_lines_are_reported_with_line_numbers() -> None:
    errors = _errors(
        """\
        # P0-009: Broken
        Status: todo
        Status: done

        ## Checklist
        - [ ] same text
        - [ ] Same text!
        - [] no space
        -[ ] no gap
        - [y] odd mark
        - plain bullet
        1. [ ] numbered box
        - [ ] ok item
        """
    )
    lines = [line for line, _ in errors]
    assert lines == [3, 7, 8, 9, 10, 11, 12]
    text = " | ".join(message for _, message in errors)
    assert "duplicate header field 'status'" in text
    assert "duplicate item key 'same-text' (first at line 6)" in text
    assert text.count("unparseable checkbox line") == 4
    assert "list item without a checkbox" in text


@P("P0-000", "malformed-input-reported-with-file-and-line")
def test_header_problems() -> None:
    assert _errors("no title here\n")[0][0] == 1
    assert parse_card("", "x.md").errors[0].line == 0
    errors = _errors("# p0-1: lower\nStatus: doing\nDepends on: P0-002, nonsense\n")
    assert [line for line, _ in errors] == [1, 2, 3]
    assert str(parse_card("\n\n# X\n", "k/x.md").errors[0]).startswith("k/x.md:3: ")


fragments = st.sampled_from(
    [
        "# P0-001: Title",
        "# bad",
        "Status: todo",
        "status: in progress",
        "Depends on: P0-002, x",
        "Priority: P1",
        "## Checklist",
        "## TDD Subtasks",
        "## Acceptance Criteria",
        "## Notes (2026-01-01)",
        "### Red",
        "1. Red",
        "2. Green",
        "- [ ] item",
        "- [x] item (manual)",
        "  - [ ] child",
        "\t- [X] tabbed",
        "- [] broken",
        "- plain",
        "```",
        "",
        "- [ ] !!!",
        "* [ ] star",
    ]
)


@P("P0-000", "parser-fuzzed-errors-never-exceptions")
@settings(max_examples=300, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.text(), st.lists(st.one_of(fragments, st.text(max_size=20))).map("\n".join)))
def test_parser_never_raises(text: str) -> None:
    result = parse_card(text, "fuzz.md")
    n_lines = len(text.split("\n"))
    for error in result.errors:
        assert 0 <= error.line <= n_lines
        assert str(error).startswith("fuzz.md:")
    if result.card is not None:
        for item in result.card.items.values():
            assert item.key and 1 <= item.line <= n_lines
            assert item.parent is None or item.parent in result.card.items
