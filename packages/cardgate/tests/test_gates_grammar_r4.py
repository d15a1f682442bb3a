"""Issue 61, part B: gates files read per YAML 1.2 and every malformed gates file or header a
card error with file and line (never a traceback); a hardware pattern must follow the hardware
name grammar; a number an item states is compared by a gates rule."""

from __future__ import annotations

from pathlib import Path

import pytest
from cardgate_repo import HOLD, PASS, USAGE, Repo

from cardgate.board import load_board
from cardgate.card import parse_card
from cardgate.thresholds import GateFormatError, load_gates, never_matching

CARD = "P0-009"
RED = "every-mechanism-fails-on-the-gate-before-this-card"
GREEN = "every-mechanism-refused-with-its-reason"


def _gates(tmp_path: Path, text: str | bytes) -> Path:
    path = tmp_path / "g.yaml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


@pytest.mark.card(CARD, "yaml-numbers-per-yaml-1-2", RED, GREEN)
def test_a_leading_zero_is_decimal_not_octal(tmp_path: Path) -> None:
    gates = load_gates(_gates(tmp_path, "version: 1\ngates:\n  - metric: m\n    min: 0750\n"))
    assert [g.min for g in gates] == [750.0]


@pytest.mark.card(CARD, "yaml-numbers-per-yaml-1-2", RED, GREEN)
@pytest.mark.parametrize(
    ("raw", "value"), [("1e5", 1.0e5), ("0o17", 15.0), ("0x10", 16.0), ("-2.5", -2.5)]
)
def test_yaml_1_2_numbers(tmp_path: Path, raw: str, value: float) -> None:
    gates = load_gates(_gates(tmp_path, f"version: 1\ngates:\n  - metric: m\n    min: {raw}\n"))
    assert [g.min for g in gates] == [value]


@pytest.mark.card(CARD, "yaml-numbers-per-yaml-1-2", RED, GREEN)
@pytest.mark.parametrize("raw", ["1:30", "1_000", "yes", ".inf", "0b101"])
def test_yaml_1_1_only_numbers_are_errors(tmp_path: Path, raw: str) -> None:
    with pytest.raises(GateFormatError, match="min"):
        load_gates(_gates(tmp_path, f"version: 1\ngates:\n  - metric: m\n    min: {raw}\n"))


@pytest.mark.card(
    CARD, "malformed-gates-and-timeouts-are-card-errors-with-file-and-line", RED, GREEN
)
@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("version: 1\ngates:\n  - ? [a, b]\n    : 1\n    metric: m\n    min: 1\n", 3),
        ("version: 1\ngates:\n  - metric: m\n    ? {x: 1}\n    : 2\n", 4),
        (b"version: 1\ngates:\n  - metric: m\n    min: 1\n    note: caf\xe9\n", 5),
        ("version: 1\ngates:\n  - metric: m\n    min: [1\n", 5),
    ],
)
def test_malformed_gates_files_name_file_and_line(
    tmp_path: Path, text: str | bytes, line: int
) -> None:
    path = _gates(tmp_path, text)
    with pytest.raises(GateFormatError) as info:
        load_gates(path)
    assert f"{path}:{line}" in str(info.value)


@pytest.mark.card(
    CARD, "malformed-gates-and-timeouts-are-card-errors-with-file-and-line", RED, GREEN
)
@pytest.mark.parametrize("raw", ["inf", "nan", "-1", "0", "1e309", "Infinity", "\u0661\u0660"])
def test_a_timeout_that_is_not_a_finite_positive_number_is_an_error(raw: str) -> None:
    result = parse_card(f"# T-001: x\nStatus: todo\nTimeout: {raw}\n", "c.md")
    assert result.card is not None and result.card.timeout is None
    assert [e.line for e in result.errors] == [3], result.errors


@pytest.mark.card(
    CARD, "malformed-gates-and-timeouts-are-card-errors-with-file-and-line", RED, GREEN
)
def test_lint_reports_a_latin1_gates_file_without_a_traceback(repo: Repo) -> None:
    repo.card(tdd=False)
    (repo.path / "worklog/gates").mkdir(parents=True)
    (repo.path / "worklog/gates/T-001.yaml").write_bytes(
        b"version: 1\ngates:\n  - metric: ops\n    min: 1\n    note: caf\xe9\n"
    )
    result = repo.cardgate("lint")
    assert result.ret == USAGE
    assert "Traceback" not in result.stdout.str() + result.stderr.str()
    result.stdout.fnmatch_lines(["*T-001-demo.md:*worklog/gates/T-001.yaml:5*UTF-8*"])


@pytest.mark.card(CARD, "hardware-patterns-follow-the-hardware-name-grammar", RED, GREEN)
@pytest.mark.parametrize("pattern", ["*H1OO*", "*A1OO*", "*h 100*", "*RTX4O90*", "*H100*x"])
def test_a_hardware_pattern_with_a_typo_is_an_error(tmp_path: Path, pattern: str) -> None:
    path = _gates(
        tmp_path,
        f"version: 1\ngates:\n  - metric: m\n    min: 1\n  - metric: m\n"
        f"    hardware: '{pattern}'\n    min: 2\n",
    )
    found = never_matching(load_gates(path))
    assert len(found) == 1 and pattern in found[0], found


@pytest.mark.card(CARD, "hardware-patterns-follow-the-hardware-name-grammar", RED, GREEN)
@pytest.mark.parametrize(
    "pattern", ["*H100*", "*h200*", "NVIDIA A100-SXM4-80GB", "*RTX 4090*", "*MI300X*", "*L40S*"]
)
def test_real_hardware_patterns_are_fine(tmp_path: Path, pattern: str) -> None:
    path = _gates(
        tmp_path, f"version: 1\ngates:\n  - metric: m\n    hardware: '{pattern}'\n    min: 1\n"
    )
    assert never_matching(load_gates(path)) == []


NUMBER_CARD = """\
# T-001: Demo card
Priority: P0
Status: in-progress
Depends on: none

## Checklist
- [ ] child one

## Acceptance Criteria
- [ ] Rust path at least 10x the Python reference
"""


@pytest.mark.card(CARD, "a-stated-number-is-bound-to-a-gates-rule", RED, GREEN)
@pytest.mark.parametrize(
    "criterion",
    [
        "Rust path at least 10x the Python reference",
        "Speed-up >= 1.8x over HF",
        "Overhead <= 3% of the step",
        "Decode step within 1.5 ms",
    ],
)
def test_a_stated_number_without_a_gates_rule_is_a_lint_error(
    tmp_path: Path, criterion: str
) -> None:
    card = tmp_path / "kanban/in-progress/T-001-demo.md"
    card.parent.mkdir(parents=True)
    card.write_text(NUMBER_CARD.replace("Rust path at least 10x the Python reference", criterion))
    errors = [str(e) for e in load_board(tmp_path).errors]
    assert any(":10:" in e and "gates rule" in e for e in errors), errors


@pytest.mark.card(CARD, "a-stated-number-is-bound-to-a-gates-rule", RED, GREEN)
def test_a_stated_number_named_by_a_gates_rule_is_fine(tmp_path: Path) -> None:
    card = tmp_path / "kanban/in-progress/T-001-demo.md"
    card.parent.mkdir(parents=True)
    card.write_text(NUMBER_CARD)
    gates = tmp_path / "worklog/gates/T-001.yaml"
    gates.parent.mkdir(parents=True)
    gates.write_text(
        "version: 1\ngates:\n  - metric: ops\n    relative: {baseline: base_ops, factor: 10}\n"
        "    items: [rust-path-at-least-10x-the-python-reference]\n"
    )
    assert [str(e) for e in load_board(tmp_path).errors] == []


@pytest.mark.card(CARD, "a-stated-number-is-bound-to-a-gates-rule", RED, GREEN)
def test_a_gates_rule_naming_an_unknown_item_is_a_lint_error(tmp_path: Path) -> None:
    card = tmp_path / "kanban/in-progress/T-001-demo.md"
    card.parent.mkdir(parents=True)
    card.write_text(NUMBER_CARD.replace("at least 10x", "faster than"))
    gates = tmp_path / "worklog/gates/T-001.yaml"
    gates.parent.mkdir(parents=True)
    gates.write_text("version: 1\ngates:\n  - metric: ops\n    min: 1\n    items: [no-such-item]\n")
    errors = [str(e) for e in load_board(tmp_path).errors]
    assert any("no-such-item" in e for e in errors), errors


# a bench test of the card's "10x" item that records 500 against 1000 (no gates file)
HALF_OF_TEN_X = """\
import pytest

@pytest.mark.card("T-001", "child one")
def test_one():
    pass

@pytest.mark.card("T-001", "rust path at least 10x the python reference")
@pytest.mark.bench
def test_two(metric):
    metric("ops", 500.0)
    metric("base_ops", 1000.0)
"""


@pytest.mark.card(CARD, "a-bench-metric-without-an-applicable-rule-holds-the-card", RED, GREEN)
def test_records_500_against_1000_without_a_gates_file_does_not_pass(repo: Repo) -> None:
    repo.write("kanban/in-progress/T-001-demo.md", NUMBER_CARD)
    repo.write(
        "tests/test_demo.py",
        HALF_OF_TEN_X,
    )
    repo.commit()
    result = repo.gate()
    assert result.ret not in (PASS,), result.stdout.str()


@pytest.mark.card(CARD, "a-bench-metric-without-an-applicable-rule-holds-the-card", RED, GREEN)
def test_a_metric_no_rule_checks_holds_the_card(repo: Repo) -> None:
    repo.write("kanban/in-progress/T-001-demo.md", NUMBER_CARD)
    repo.write(
        "tests/test_demo.py",
        HALF_OF_TEN_X,
    )
    repo.write(
        "worklog/gates/T-001.yaml",
        "version: 1\ngates:\n  - metric: base_ops\n    min: 1\n"
        "    items: [rust-path-at-least-10x-the-python-reference]\n",
    )
    repo.commit()
    result = repo.gate()
    assert result.ret == HOLD, result.stdout.str()
    result.stdout.fnmatch_lines(["*metric ops*no gates rule*"])
