"""`tools/ci/gpu_cards.py`: which cards `nox -s gpu` gates on a GPU runner."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "ci" / "gpu_cards.py"

CARD = "# {id}: card {id}\nPriority: P1\nStatus: {lane}\n{extra}\n## Checklist\n- [ ] an item\n"


def write_card(root: Path, lane: str, card_id: str, extra: str = "") -> None:
    path = root / "kanban" / lane / f"{card_id}-x.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(CARD.format(id=card_id, lane=lane, extra=extra))


def write_gates(root: Path, card_id: str, hardware: str) -> None:
    path = root / "worklog" / "gates" / f"{card_id}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        f"version: 1\ngates:\n  - metric: tok_s\n    hardware: '{hardware}'\n    min: 1\n"
    )


def run(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--root", str(root), *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )


def test_lists_not_done_cards_that_ask_for_a_gpu(tmp_path):
    write_card(tmp_path, "todo", "T-001", "Hardware: gpu")
    write_card(tmp_path, "in-progress", "T-002")
    write_gates(tmp_path, "T-002", "*H100*")
    write_card(tmp_path, "todo", "T-003")
    write_gates(tmp_path, "T-003", "cpu")
    write_card(tmp_path, "done", "T-004", "Hardware: gpu")
    write_card(tmp_path, "backlog", "T-005", "Hardware: gpu")
    listed = run(tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.split() == ["T-002", "T-001"]


def test_gate_with_nothing_to_gate_says_so(tmp_path):
    write_card(tmp_path, "todo", "T-003")
    done = run(tmp_path, "--gate")
    assert done.returncode == 0
    assert "no card needs GPU evidence" in done.stdout


def test_gate_fails_when_a_card_does_not_pass(tmp_path):
    done = run(tmp_path, "--gate", "T-404")  # no such card: cardgate refuses (usage error)
    assert done.returncode == 1
    assert "T-404 error" in done.stdout


def test_tree_changes_ignore_evidence_and_see_everything_else(tmp_path):
    sys.path.insert(0, str(SCRIPT.parent))
    from gpu_cards import tree_changes

    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    write_card(tmp_path, "todo", "T-001")
    (tmp_path / "worklog" / "evidence" / "T-001" / "run").mkdir(parents=True)
    (tmp_path / "worklog" / "evidence" / "T-001" / "run" / "summary.json").write_text("{}")
    assert tree_changes(tmp_path) == ["kanban/todo/T-001-x.md"]
