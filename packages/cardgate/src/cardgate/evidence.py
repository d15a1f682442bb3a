"""Evidence records under `worklog/evidence/<ID>/<UTC timestamp>-<short sha>-<phase>/`.

A record directory holds `manifest.json`, `report.jsonl`, `metrics.json` and, written last,
`summary.json` (the decision). Directories are claimed with an exclusive `mkdir` and files are
written to a temporary name and hard-linked into place, so nothing is ever overwritten; a
directory without `summary.json` is an interrupted run and is ignored. Files are world-readable
(0644), directories 0755.

`summary.json` carries `digest`: the sha256 of the other files and of the summary itself (a
record the gate wrote; a hand-written or hand-edited record does not verify). It is a checksum
against mistakes and hand edits, not a signature against a forger with the source code.

Records are ordered by `started_utc` inside the summary (covered by the digest; to the
microsecond since 2026-12-07, so two gates of a card in one second order by when they began,
not by their folder names' commit hashes), never by the folder name: a record whose folder name
disagrees with its stamp (renamed to outrank a later gate) or whose stamp lies in the future
is refused (`refused_records`, a board lint error) and left out of `records`. A record from before stamps is ordered by its folder name.

Nothing named in `CARDGATE_PRIVATE_NAMES` (nor this machine's user and host name) is written
into a record: `write_json` and `write_jsonl` replace each with `<private>`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

EVIDENCE_ROOT = Path("worklog") / "evidence"
SUMMARY = "summary.json"
DIGEST_FILES = ("manifest.json", "report.jsonl", "metrics.json")
FILE_MODE = 0o644
DIR_MODE = 0o755
FUTURE_SLACK = timedelta(minutes=5)  # clock skew between machines sharing a repository
_STAMP_RE = re.compile(r"^(?P<stamp>[0-9]{8}T[0-9]{6}Z)-")


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
        os.chmod(tmp, FILE_MODE)
        os.link(tmp, path)
    finally:
        os.unlink(tmp)


def _private(text: str) -> str:
    from cardgate.redact import scrub_names  # lazy: redact imports nothing of ours, but light

    return scrub_names(text)


def write_json(path: Path, data: Any) -> None:
    write_new(path, _private(json.dumps(data, indent=2, sort_keys=True) + "\n").encode())


def write_jsonl(path: Path, records: Iterable[dict[str, Any]]) -> None:
    lines = "".join(json.dumps(r, sort_keys=True) + "\n" for r in records)
    write_new(path, _private(lines).encode())


def create_record_dir(
    root: Path, card_id: str, short_sha: str, phase: str, started: datetime | None = None
) -> Path:
    """Claim a fresh evidence directory (a `-2`, `-3`... suffix when the name is taken)."""
    base = root / EVIDENCE_ROOT / card_id
    for parent in (base.parent.parent, base.parent, base):
        if not parent.is_dir():
            parent.mkdir(parents=True, exist_ok=True)
            os.chmod(parent, DIR_MODE)
    name = f"{utc_stamp(started)}-{short_sha}-{phase}"
    for attempt in range(1, 1000):
        candidate = base / (name if attempt == 1 else f"{name}-{attempt}")
        try:
            candidate.mkdir()
        except FileExistsError:
            continue
        os.chmod(candidate, DIR_MODE)
        return candidate
    raise FileExistsError(f"no free evidence directory name under {base}")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def record_digest(directory: Path, summary: dict[str, Any]) -> str:
    """sha256 over the record's files and its summary (without the digest field)."""
    body = {k: v for k, v in summary.items() if k != "digest"}
    files = {n: _sha256(directory / n) for n in DIGEST_FILES if (directory / n).is_file()}
    payload = json.dumps(
        {"kind": "cardgate-record-v1", "files": files, "summary": body}, sort_keys=True
    )
    return hashlib.sha256(payload.encode()).hexdigest()


def write_summary(directory: Path, summary: dict[str, Any]) -> None:
    """Write `summary.json` last, with its digest (over the summary as written: private names
    are replaced before the digest is taken)."""
    clean = json.loads(_private(json.dumps(summary)))
    write_json(directory / SUMMARY, {**clean, "digest": record_digest(directory, clean)})


@dataclass(frozen=True)
class Record:
    path: Path
    summary: dict[str, Any]

    @property
    def intact(self) -> bool:
        """The summary carries a digest that matches the record's files (the gate wrote it)."""
        digest = self.summary.get("digest")
        return isinstance(digest, str) and digest == record_digest(self.path, self.summary)

    @property
    def card(self) -> str:
        return str(self.summary.get("card_id", "?"))

    @property
    def commit(self) -> str:
        return str(self.summary.get("commit") or "")

    def manifest(self) -> dict[str, Any]:
        try:
            data = json.loads((self.path / "manifest.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def report_lines(self) -> list[dict[str, Any]]:
        try:
            text = (self.path / "report.jsonl").read_text(encoding="utf-8")
            return [json.loads(line) for line in text.splitlines() if line.strip()]
        except (OSError, ValueError):
            return []

    @property
    def outcome(self) -> str:
        return str(self.summary.get("outcome", "?"))

    @property
    def phase(self) -> str:
        return str(self.summary.get("phase", "?"))


def _stamp(text: str) -> datetime | None:
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        try:
            when = datetime.strptime(text, "%Y%m%dT%H%M%SZ").replace(tzinfo=UTC)
        except ValueError:
            return None
    return when if when.tzinfo is not None else None


def _order(directory: Path, summary: dict[str, Any], now: datetime) -> datetime | str:
    """The record's stamp, or why it is refused (a string)."""
    folder = _STAMP_RE.match(directory.name)
    raw = summary.get("started_utc")
    if raw is None:  # from before stamps in summaries: the folder name is all there is
        if folder is None:
            return "no stamp in its summary and none in its folder name"
        raw = folder.group("stamp")
    when = _stamp(raw) if isinstance(raw, str) else None
    if when is None:
        return f"unreadable stamp {raw!r}"
    if folder is not None and folder.group("stamp") != utc_stamp(when.astimezone(UTC)):
        return (
            f"its folder name says {folder.group('stamp')} but its stamp says "
            f"{utc_stamp(when.astimezone(UTC))}: the folder name disagrees (renamed?)"
        )
    if when > now + FUTURE_SLACK:
        return f"stamped {when.isoformat()}, in the future"
    return when


def _scan(root: Path, card_id: str) -> tuple[list[Record], list[tuple[Path, str]]]:
    base = root / EVIDENCE_ROOT / card_id
    if not base.is_dir():
        return [], []
    now = datetime.now(UTC)
    found: list[tuple[datetime, str, Record]] = []
    refused: list[tuple[Path, str]] = []
    for directory in sorted(p for p in base.iterdir() if p.is_dir()):
        try:
            summary = json.loads((directory / SUMMARY).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if not isinstance(summary, dict):
            continue
        when = _order(directory, summary, now)
        if isinstance(when, str):
            refused.append((directory, when))
        else:
            found.append((when, directory.name, Record(directory, summary)))
    found.sort(key=lambda entry: (entry[0], entry[1]))
    return [record for _, _, record in found], refused


def records(root: Path, card_id: str) -> list[Record]:
    """Every complete, accepted record of a card, oldest first by the stamp in its summary."""
    return _scan(root, card_id)[0]


def refused_records(root: Path, card_id: str) -> list[tuple[Path, str]]:
    """(folder, reason) per record left out of `records`: a folder name that disagrees with
    the record's stamp, a stamp in the future or none at all."""
    return _scan(root, card_id)[1]


def last_record(root: Path, card_id: str) -> Record | None:
    found = records(root, card_id)
    return found[-1] if found else None
