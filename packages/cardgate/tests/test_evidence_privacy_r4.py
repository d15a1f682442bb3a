"""Issue 61, part B: evidence ordered by the stamp inside its digest (not its folder name),
future stamps refused; private names never reach a record; the privacy lint reads every
tracked text file, notebooks and `file://` URLs included; the board reads subscripted markers
as the gate binds them, and a marker argument nobody can read is a lint error."""

from __future__ import annotations

import json
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cardgate_repo import Repo, ready

from cardgate import evidence, privacy
from cardgate.board import board_json, load_board
from cardgate.verify import verify_card

CARD = "P0-009"
RED = "every-mechanism-fails-on-the-gate-before-this-card"
GREEN = "every-mechanism-refused-with-its-reason"


def _record(root: Path, name: str, started: datetime, outcome: str) -> Path:
    directory = root / evidence.EVIDENCE_ROOT / "T-001" / name
    directory.mkdir(parents=True)
    evidence.write_json(directory / "manifest.json", {"card": "T-001"})
    evidence.write_summary(
        directory,
        {
            "card_id": "T-001",
            "phase": "green",
            "outcome": outcome,
            "started_utc": started.isoformat(timespec="seconds"),
        },
    )
    return directory


@pytest.mark.card(
    CARD, "evidence-ordered-by-its-digest-protected-stamp-future-stamps-refused", RED, GREEN
)
def test_records_are_ordered_by_their_stamp_not_their_folder_name(tmp_path: Path) -> None:
    t0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    later = t0 + timedelta(hours=1)
    _record(tmp_path, f"{evidence.utc_stamp(t0)}-aaaaaaa-green", t0, "pass")
    _record(tmp_path, f"{evidence.utc_stamp(later)}-bbbbbbb-green", later, "fail")
    # a renamed copy of the passing record: its name says 2030, its stamp says t0
    _record(tmp_path, "20300101T000000Z-aaaaaaa-green", t0, "pass")
    found = evidence.records(tmp_path, "T-001")
    assert [r.outcome for r in found] == ["pass", "fail"]
    refused = evidence.refused_records(tmp_path, "T-001")
    assert [p.name for p, _ in refused] == ["20300101T000000Z-aaaaaaa-green"]
    assert "disagrees" in refused[0][1]


@pytest.mark.card(
    CARD, "evidence-ordered-by-its-digest-protected-stamp-future-stamps-refused", RED, GREEN
)
def test_a_record_stamped_in_the_future_is_refused(tmp_path: Path) -> None:
    t0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    future = datetime.now(UTC) + timedelta(days=30)
    _record(tmp_path, f"{evidence.utc_stamp(t0)}-aaaaaaa-green", t0, "fail")
    _record(tmp_path, f"{evidence.utc_stamp(future)}-bbbbbbb-green", future, "pass")
    assert [r.outcome for r in evidence.records(tmp_path, "T-001")] == ["fail"]
    refused = evidence.refused_records(tmp_path, "T-001")
    assert len(refused) == 1 and "future" in refused[0][1]


@pytest.mark.card(
    CARD, "evidence-ordered-by-its-digest-protected-stamp-future-stamps-refused", RED, GREEN
)
def test_a_renamed_passing_record_does_not_outrank_a_later_failing_gate(repo: Repo) -> None:
    ready(repo)
    assert repo.gate().ret == 0
    repo.git("commit", "-q", "-m", "done", "--", "kanban", "worklog")
    passing = repo.evidence()[-1]
    card = next(iter(load_board(repo.path).cards.values()))
    assert verify_card(repo.path, card).verified
    repo.tests(impl="False", tdd=False)
    repo.commit("break it")
    assert repo.gate().ret == 1
    passing.rename(passing.with_name("20991231T235959Z-" + passing.name.split("-", 1)[1]))
    card = next(iter(load_board(repo.path).cards.values()))
    assert not verify_card(repo.path, card).verified
    errors = [str(e) for e in load_board(repo.path).errors]
    assert any("20991231T235959Z" in e and "refused" in e for e in errors), errors


@pytest.mark.card(CARD, "private-names-never-reach-a-record", RED, GREEN)
def test_private_names_are_not_copied_into_the_manifest(
    repo: Repo, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CARDGATE_PRIVATE_NAMES", "zorblax-secret,quuxhost")
    ready(repo)
    repo.gate()
    record = repo.evidence()[-1]
    for path in record.iterdir():
        text = path.read_text()
        assert "zorblax-secret" not in text and "quuxhost" not in text, path.name
    assert evidence.Record(record, json.loads((record / "summary.json").read_text())).intact


def _git_repo(root: Path) -> None:
    subprocess.run(["git", "init", "-q", str(root)], check=True)


def _track(root: Path, *paths: str) -> None:
    subprocess.run(["git", "-C", str(root), "add", "-f", *paths], check=True)


@pytest.mark.card(
    CARD, "the-lint-scans-every-tracked-text-file-notebooks-and-file-urls", RED, GREEN
)
def test_the_lint_reads_notebooks_dot_folders_and_file_urls(tmp_path: Path) -> None:
    _git_repo(tmp_path)
    notebook = {
        "cells": [
            {
                "cell_type": "code",
                "outputs": [{"text": ["loaded /home/alice/models/x.bin\n"]}],
                "source": [],
            }
        ]
    }
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "notebooks/run.ipynb").write_text(json.dumps(notebook, indent=1))
    (tmp_path / "worklog/.notes").mkdir(parents=True)
    (tmp_path / "worklog/.notes/today.md").write_text("see /scratch/bob/run1 for logs\n")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs/page.md").write_text("open file:///home/carol/report.html\n")
    (tmp_path / "worklog/bench.out").write_text("wrote /home/dave/out.json\n")
    _track(tmp_path, "notebooks/run.ipynb", "worklog/.notes/today.md", "docs/page.md")
    _track(tmp_path, "worklog/bench.out")
    found = {(f.path, f.kind) for f in privacy.scan(tmp_path).findings}
    assert found >= {
        ("notebooks/run.ipynb", "absolute path"),
        ("worklog/.notes/today.md", "absolute path"),
        ("docs/page.md", "absolute path"),
        ("worklog/bench.out", "absolute path"),
    }, found


@pytest.mark.card(CARD, "the-board-and-the-gate-agree-on-subscripted-markers", RED, GREEN)
def test_a_subscripted_marker_argument_counts_on_the_board(tmp_path: Path) -> None:
    (tmp_path / "kanban/done").mkdir(parents=True)
    (tmp_path / "kanban/done/T-001-x.md").write_text(
        "# T-001: x\nStatus: done\n\n## Checklist\n- [x] main\n"
    )
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests/test_x.py").write_text(
        'import pytest\nITEMS = {"main": "main"}\n\n'
        '@pytest.mark.card("T-001", ITEMS["main"])\ndef test_x():\n    pass\n'
    )
    row = board_json(tmp_path)["cards"][0]
    assert (row["bound"], row["unbound"]) == (1, 0), row


@pytest.mark.card(CARD, "the-board-and-the-gate-agree-on-subscripted-markers", RED, GREEN)
def test_an_unreadable_marker_argument_is_a_lint_error(tmp_path: Path) -> None:
    (tmp_path / "kanban/todo").mkdir(parents=True)
    (tmp_path / "kanban/todo/T-001-x.md").write_text(
        "# T-001: x\nStatus: todo\n\n## Checklist\n- [ ] main\n"
    )
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests/test_x.py").write_text(
        'import pytest\n\n\ndef pick():\n    return "main"\n\n\n'
        '@pytest.mark.card("T-001", pick())\ndef test_x():\n    pass\n'
    )
    errors = [str(e) for e in load_board(tmp_path).errors]
    assert any(e.startswith("tests/test_x.py:8:") and "marker" in e for e in errors), errors
