"""No absolute local path, user or host name or token in the repository's text files.

`scan(root)` lists every finding as `file:line: kind ...` (`cardgate lint` prints them and
exits 3). Files read: every file under `kanban/`, `worklog/` and `docs/` (dot folders such as
`worklog/.notes/` included) and every file git tracks there, plus every tracked notebook
(`.ipynb`, outputs included: the JSON text is read as it is) anywhere in the repository; a file
is text when it decodes as UTF-8 without NUL bytes, whatever its suffix. Names checked: this
machine's user and host name (when specific enough: not `root`, `runner`, ...) and those in
`CARDGATE_PRIVATE_NAMES` (comma-separated). Paths: `redact`'s `PRIVATE_PATH_RE` (home, tmp,
scratch and workspace folders) and every `file://` URL. Tokens: GitHub, Hugging Face, OpenAI,
AWS, Slack and GitLab token shapes and private key blocks.

`migrate(root)` rewrites the paths in `worklog/` with `redact` (the root becomes `.`, home `~`,
the temporary directory `<tmp>`, other private folders `<local>`). A gate record is rewritten
only if its digest verified before; its summary then gets a `migrations` entry (date, note,
files, previous digest) and a digest over the new content, so `verify` keeps accepting it and
the history says what changed; a record from before digests is rewritten with the note and
still verifies nothing; one whose digest fails is left alone and reported. Cards and docs are listed, not rewritten (a card's text is
what its records are bound to).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cardgate import evidence
from cardgate.redact import NAMES_ENV, PRIVATE_PATH_RE, private_names, redact

__all__ = ["NAMES_ENV", "Finding", "ScanResult", "migrate", "private_names", "scan", "scan_text"]

SCANNED_DIRS = ("kanban", "worklog", "docs")
TRACKED_ANYWHERE = (".ipynb",)
MAX_BYTES = 20 << 20
FILE_URL_RE = re.compile(r"\bfile://(?:localhost)?/[^\s\"'`<>)\]}]+", re.IGNORECASE)
TOKEN_RE = re.compile(
    r"\b(?:gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{30,}|hf_[A-Za-z0-9]{30,}"
    r"|sk-[A-Za-z0-9_-]{20,}|AKIA[0-9A-Z]{16}|xox[abprs]-[A-Za-z0-9-]{10,}"
    r"|glpat-[A-Za-z0-9_-]{20,})|-----BEGIN [A-Z ]*PRIVATE KEY-----"
)
MIGRATION_NOTE = (
    "absolute local paths replaced by cardgate migrate-paths (repository root -> '.', home "
    "-> '~', temporary directory -> '<tmp>', other private folders -> '<local>'); nothing else "
    "changed"
)


@dataclass(frozen=True, order=True)
class Finding:
    path: str
    line: int
    kind: str
    text: str

    def __str__(self) -> str:
        advice = {
            "absolute path": "store repo-relative paths or a placeholder (cardgate migrate-paths)",
            "user or host name": "leave out who and where a run was made",
            "token": "revoke it and remove it from history",
        }[self.kind]
        return f"{self.path}:{self.line}: {self.kind} {self.text!r}: {advice}"


@dataclass(frozen=True)
class ScanResult:
    findings: tuple[Finding, ...]
    files: int


def _tracked(root: Path) -> list[Path]:
    """Files git tracks under `root` (none outside a work tree)."""
    try:
        proc = subprocess.run(
            ["git", "-C", str(root), "ls-files", "-z", "--cached"],
            capture_output=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return []
    names = proc.stdout.decode("utf-8", "surrogateescape").split("\0")
    return [root / name for name in names if name]


def _files(root: Path, dirs: tuple[str, ...] = SCANNED_DIRS) -> list[Path]:
    found: set[Path] = set()
    for name in dirs:
        base = root / name
        if not base.is_dir():
            continue
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = sorted(d for d in dirnames if d != ".git")
            found.update(Path(dirpath) / filename for filename in filenames)
    for path in _tracked(root):
        rel = path.relative_to(root)
        if rel.parts[0] in dirs or (
            dirs == SCANNED_DIRS and path.suffix.lower() in TRACKED_ANYWHERE
        ):
            found.add(path)
    return sorted(p for p in found if p.is_file() and p.stat().st_size <= MAX_BYTES)


def _read_text(path: Path) -> str | None:
    """The file's text, or None when it is binary (a NUL byte) or not UTF-8."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def scan_text(text: str, rel: str, names: list[str]) -> list[Finding]:
    name_re = (
        re.compile(r"(?<![\w.-])(?:" + "|".join(map(re.escape, names)) + r")(?![\w-])")
        if names
        else None
    )
    found: list[Finding] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        found.extend(
            Finding(rel, lineno, "absolute path", m.group(0))
            for m in PRIVATE_PATH_RE.finditer(line)
        )
        found.extend(
            Finding(rel, lineno, "absolute path", m.group(0)) for m in FILE_URL_RE.finditer(line)
        )
        found.extend(
            Finding(rel, lineno, "token", m.group(0)[:12] + "...") for m in TOKEN_RE.finditer(line)
        )
        if name_re is not None:
            found.extend(
                Finding(rel, lineno, "user or host name", m.group(0))
                for m in name_re.finditer(line)
            )
    return found


def scan(root: Path) -> ScanResult:
    names = private_names()
    findings: list[Finding] = []
    files = _files(root)
    for path in files:
        text = _read_text(path)
        if text is None:
            continue
        findings.extend(scan_text(text, path.relative_to(root).as_posix(), names))
    return ScanResult(tuple(sorted(findings)), len(files))


def _rewrite(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(text)
    os.chmod(tmp, evidence.FILE_MODE)
    os.replace(tmp, path)


def _record_dir(root: Path, path: Path) -> Path | None:
    """The gate record folder `path` is in (`worklog/evidence/<ID>/<record>/`), if any."""
    try:
        parts = path.relative_to(root / evidence.EVIDENCE_ROOT).parts
    except ValueError:
        return None
    return root / evidence.EVIDENCE_ROOT / parts[0] / parts[1] if len(parts) >= 3 else None


def _migrate_record(root: Path, directory: Path, dry_run: bool) -> str:
    rel = directory.relative_to(root).as_posix()
    summary_path = directory / evidence.SUMMARY
    try:
        summary: dict[str, Any] = json.loads(summary_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return f"skipped {rel}: no readable summary.json"
    legacy = "digest" not in summary  # written before records had digests: verifies nothing
    if not legacy and not evidence.Record(directory, summary).intact:
        return f"skipped {rel}: its digest did not verify before the migration (edited by hand?)"
    changed: list[str] = []
    new_texts: dict[Path, str] = {}
    for path in sorted(p for p in directory.iterdir() if p.is_file()):
        text = path.read_text(encoding="utf-8")
        redacted = redact(text, root)
        if redacted != text:
            changed.append(path.name)
            new_texts[path] = redacted
    if not changed:
        return ""
    if dry_run:
        return f"would migrate {rel}: {', '.join(changed)}"
    for path, text in new_texts.items():
        if path != summary_path:
            _rewrite(path, text)
    body = json.loads(new_texts.get(summary_path, summary_path.read_text(encoding="utf-8")))
    body.pop("digest", None)
    note = {
        "utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "note": MIGRATION_NOTE,
        "files": changed,
        "previous_digest": summary.get("digest"),
    }
    body["migrations"] = [*body.get("migrations", []), note]
    if legacy:
        note["note"] += "; a record from before digests, so it still verifies no card"
    else:
        body["digest"] = evidence.record_digest(directory, body)
    _rewrite(summary_path, json.dumps(body, indent=2, sort_keys=True) + "\n")
    what = "no digest before or after" if legacy else "digest renewed"
    return f"migrated {rel}: {', '.join(changed)} ({what}, note added)"


def migrate(root: Path, dry_run: bool = False) -> list[str]:
    """Rewrite the absolute paths of `worklog/`; returns one line per file or record."""
    lines: list[str] = []
    records: set[Path] = set()
    for path in _files(root, ("worklog",)):
        text = _read_text(path)
        if text is None:
            continue
        if not PRIVATE_PATH_RE.search(text) and redact(text, root) == text:
            continue
        record = _record_dir(root, path)
        if record is not None:
            records.add(record)
            continue
        rel = path.relative_to(root).as_posix()
        if dry_run:
            lines.append(f"would migrate {rel}")
            continue
        _rewrite(path, redact(text, root))
        lines.append(f"migrated {rel}")
    lines.extend(line for d in sorted(records) if (line := _migrate_record(root, d, dry_run)))
    for finding in scan(root).findings:
        if not finding.path.startswith("worklog/") or finding.kind != "absolute path":
            lines.append(f"left for a person: {finding}")
    return lines
