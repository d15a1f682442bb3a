"""Evidence records under `worklog/evidence/<ID>/<UTC timestamp>-<short sha>-<phase>/`.

A record directory holds `manifest.json`, `report.jsonl`, `metrics.json` and, written last,
`summary.json` (the decision). Directories are claimed with an exclusive `mkdir` and files are
written to a temporary name and hard-linked into place, so nothing is ever overwritten; a
directory without `summary.json` is an interrupted run and is ignored.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

EVIDENCE_ROOT = Path("worklog") / "evidence"
SUMMARY = "summary.json"


def utc_stamp(now: datetime | None = None) -> str:
    return (now or datetime.now(UTC)).strftime("%Y%m%dT%H%M%SZ")


def write_new(path: Path, data: bytes) -> None:
    """Write `path` atomically; raises FileExistsError instead of ever replacing a file."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.link(tmp, path)
    finally:
        os.unlink(tmp)


def write_json(path: Path, data: Any) -> None:
    write_new(path, (json.dumps(data, indent=2, sort_keys=True) + "\n").encode())


def write_jsonl(path: Path, records: Iterable[dict[str, Any]]) -> None:
    lines = "".join(json.dumps(r, sort_keys=True) + "\n" for r in records)
    write_new(path, lines.encode())


def create_record_dir(root: Path, card_id: str, short_sha: str, phase: str) -> Path:
    """Claim a fresh evidence directory (a `-2`, `-3`... suffix when the name is taken)."""
    base = root / EVIDENCE_ROOT / card_id
    base.mkdir(parents=True, exist_ok=True)
    name = f"{utc_stamp()}-{short_sha}-{phase}"
    for attempt in range(1, 1000):
        candidate = base / (name if attempt == 1 else f"{name}-{attempt}")
        try:
            candidate.mkdir()
        except FileExistsError:
            continue
        return candidate
    raise FileExistsError(f"no free evidence directory name under {base}")


@dataclass
class Record:
    path: Path
    summary: dict[str, Any]

    @property
    def outcome(self) -> str:
        return str(self.summary.get("outcome", "?"))

    @property
    def phase(self) -> str:
        return str(self.summary.get("phase", "?"))


def records(root: Path, card_id: str) -> list[Record]:
    """Every complete record of a card, oldest first."""
    base = root / EVIDENCE_ROOT / card_id
    if not base.is_dir():
        return []
    out: list[Record] = []
    for directory in sorted(p for p in base.iterdir() if p.is_dir()):
        try:
            summary = json.loads((directory / SUMMARY).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(summary, dict):
            out.append(Record(directory, summary))
    return out


def last_record(root: Path, card_id: str) -> Record | None:
    found = records(root, card_id)
    return found[-1] if found else None
