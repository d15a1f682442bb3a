"""Re-checking evidence: is a done card backed by a gate record, and which red records count.

A card in `done/` is *verified* when a record the gate wrote (its digest checks) says `pass`
for the green phase of this card with `card_sha256` equal to the sha256 of the card file as it
is now, at a commit this repository knows. Anything else is a flag.

A red record counts for a Red item when the gate wrote it for this card, its commit is a strict
ancestor of HEAD (resolved with git), the tree was clean, it names bound tests of the item that
failed in the call phase by assertion, and files other than tests, cards and evidence changed
between that commit and HEAD (tests, `conftest.py`, `kanban/`, `worklog/`, `docs/` and markdown
files do not count as implementation).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from cardgate import evidence, gitutil
from cardgate.card import Card

NOT_IMPLEMENTATION = re.compile(
    r"(^|/)(tests?|testing)/|(^|/)test_[^/]*\.py$|_test\.py$|(^|/)conftest\.py$"
    r"|^kanban/|^worklog/|^docs/|\.md$"
)


@dataclass(frozen=True)
class LastGate:
    outcome: str
    utc: str | None
    commit: str | None
    evidence_dir: str
    phase: str

    def to_dict(self) -> dict[str, str | None]:
        return {
            "outcome": self.outcome,
            "utc": self.utc,
            "commit": self.commit,
            "evidence_dir": self.evidence_dir,
            "phase": self.phase,
        }


@dataclass(frozen=True)
class Verification:
    """`verified` is None for cards not in done/."""

    verified: bool | None
    flags: tuple[str, ...]
    last_gate: LastGate | None


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _last_gate(root: Path, record: evidence.Record) -> LastGate:
    s = record.summary
    return LastGate(
        outcome=str(s.get("outcome", "?")),
        utc=s.get("finished_utc") or s.get("started_utc"),
        commit=s.get("commit"),
        evidence_dir=record.path.relative_to(root).as_posix(),
        phase=str(s.get("phase", "?")),
    )


def verify_card(root: Path, card: Card) -> Verification:
    records = evidence.records(root, card.id)
    last = _last_gate(root, records[-1]) if records else None
    if card.lane != "done":
        return Verification(None, (), last)
    try:
        current = file_sha256(root / card.path)
    except OSError:
        return Verification(False, ("card file unreadable",), last)
    passing = [
        r
        for r in records
        if r.outcome == "pass" and r.phase == "green" and r.card == card.id and r.intact
    ]
    matching = [r for r in passing if r.summary.get("card_sha256") == current]
    if not matching:
        why = (
            "in done/ without a passing gate record for its current text"
            + (" (the card changed after its last passing gate)" if passing else "")
            + f": re-gate it (python -m cardgate gate {card.id} --commit)"
        )
        return Verification(False, (why,), last)
    record = matching[-1]
    if gitutil.is_repo(root) and gitutil.resolve(root, record.commit) is None:
        return Verification(
            False,
            (f"passing record {record.path.name} names unknown commit {record.commit}",),
            last,
        )
    return Verification(True, (), last)


@dataclass(frozen=True)
class RedEvidence:
    """Valid red records per Red item key, and why other red records were rejected."""

    found: dict[str, tuple[str, ...]]
    rejected: tuple[str, ...]


def red_evidence(
    root: Path, card: Card, head: str | None, bound: dict[str, tuple[str, ...]]
) -> RedEvidence:
    found: dict[str, list[str]] = {}
    rejected: list[str] = []
    if head is None:
        return RedEvidence({}, ())
    for record in evidence.records(root, card.id):
        s = record.summary
        if s.get("phase") != "red":
            continue
        name = record.path.name
        problem = _red_problem(root, record, card, head)
        if problem:
            rejected.append(f"{name}: {problem}")
            continue
        failed_by_assertion = {
            line["nodeid"]
            for line in record.report_lines()
            if line.get("when") == "call"
            and line.get("outcome") == "failed"
            and line.get("failure") == "assertion"
        }
        # each Red item on its own: the run may have failed on another one (a Red item whose
        # tests already pass), which says nothing about this one's red result
        red_as_expected = {i.get("key") for i in s.get("items") or () if i.get("status") == "pass"}
        for key, nodeids in (s.get("red_failures") or {}).items():
            if key not in red_as_expected:
                rejected.append(f"{name}: {key}: not red as expected in that run")
                continue
            valid = set(nodeids) & failed_by_assertion & set(bound.get(key, ()))
            if valid:
                found.setdefault(key, []).append(f"{record.commit[:10]} {name}")
            else:
                rejected.append(f"{name}: {key}: no bound test of the item failed by assertion")
    return RedEvidence({k: tuple(v) for k, v in found.items()}, tuple(rejected))


def _red_problem(root: Path, record: evidence.Record, card: Card, head: str) -> str:
    s = record.summary
    if not record.intact:
        return "not a record the gate wrote (digest missing or wrong)"
    if record.card != card.id:
        return f"record of {record.card}, not {card.id}"
    if s.get("dirty"):
        return "not a clean red run (dirty working tree)"
    commit = gitutil.resolve(root, record.commit)
    if commit is None or not gitutil.is_strict_ancestor(root, commit, head):
        return f"commit {record.commit[:10]!r} is not a strict ancestor of HEAD"
    changed = [
        f for f in gitutil.changed_files(root, commit, head) if not NOT_IMPLEMENTATION.search(f)
    ]
    if not changed:
        return "no implementation file changed since the red commit (only tests, cards, evidence)"
    return ""
