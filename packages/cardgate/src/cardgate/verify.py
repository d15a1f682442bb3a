"""Re-checking evidence: is a done card backed by a gate record, and which red records count.

A card in `done/` is *verified* when a record the gate wrote (its digest checks) says `pass`
for the green phase of this card with `card_sha256` equal to the sha256 of the card file as it
is now, at a commit that is HEAD or one of its ancestors (not a record copied from another
branch), and no later green gate of the same card text failed. Anything else is a flag.

A red record counts for a Red item when the gate wrote it for this card, its commit is a strict
ancestor of HEAD (resolved with git), the tree was clean, it names bound tests of the item that
failed in the call phase by assertion, those tests' sources are unchanged since (or the gate was
told `--allow-changed-tests`, and records it), and the implementation changed between that
commit and HEAD: a file the bound tests import now (or a compiled-language source), never
tests, `conftest.py`, `kanban/`, `worklog/`, `docs/`, markdown or a file nothing imports.
A red run in which any check failed (an undeclared plugin, a foreign start-up file, ...) is no
red record, whatever its items say.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cardgate import evidence, gitutil
from cardgate.card import Card

COMPILED_SOURCES = (".rs", ".c", ".cc", ".cpp", ".h", ".hpp", ".cu", ".cuh", ".pyx")
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


def newest_green(root: Path, card: Card) -> evidence.Record | None:
    """The newest passing green record the gate wrote for this card (what `verify --rerun`
    re-runs), or None."""
    passing = [
        r
        for r in evidence.records(root, card.id)
        if r.outcome == "pass" and r.phase == "green" and r.card == card.id and r.intact
    ]
    return passing[-1] if passing else None


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
    # records are in stamp order (evidence.records): what follows the last passing record in
    # that list is later, whatever the folder names say (two gates in one second share their
    # folders' stamp and then sort by commit hash)
    after = records[records.index(matching[-1]) + 1 :]
    later = [
        r
        for r in after
        if r.phase == "green"
        and r.card == card.id
        and r.intact
        and r.summary.get("card_sha256") == current
        and r.outcome == "fail"
    ]
    if later:
        return Verification(
            False,
            (
                f"the last gate of this card text failed ({later[-1].path.name}, after the "
                f"passing {matching[-1].path.name}): fix it and re-gate",
            ),
            last,
        )
    record = matching[-1]
    if gitutil.is_repo(root):
        head = gitutil.head(root)
        if gitutil.resolve(root, record.commit) is None:
            return Verification(
                False,
                (f"passing record {record.path.name} names unknown commit {record.commit}",),
                last,
            )
        if head is not None and not gitutil.is_ancestor(root, record.commit, head):
            return Verification(
                False,
                (
                    f"passing record {record.path.name} names commit {record.commit[:10]}, "
                    "which is not an ancestor of HEAD (a record copied from another branch?): "
                    "re-gate it here",
                ),
                last,
            )
    return Verification(True, (), last)


@dataclass(frozen=True)
class RedEvidence:
    """Valid red records per Red item key, and why other red records were rejected."""

    found: dict[str, tuple[str, ...]]
    rejected: tuple[str, ...]
    notes: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def why_not(self, key: str) -> str:
        """The last rejection that names `key`, else the last one."""
        mine = [r for r in self.rejected if f": {key}: " in r]
        return (mine or list(self.rejected) or [""])[-1]


def red_evidence(
    root: Path,
    card: Card,
    head: str | None,
    bound: dict[str, tuple[str, ...]],
    *,
    sources: dict[str, str] | None = None,
    test_sides: dict[str, dict[str, Any]] | None = None,
    modules: tuple[str, ...] | None = None,
    allow_changed: bool = False,
) -> RedEvidence:
    """Red records that prove each Red item. With `sources` (nodeid -> source sha256 of this
    run), a record whose bound test changed since is rejected unless `allow_changed`; with
    `modules` (repo files this run imported), "the implementation changed" means one of them
    (or a compiled-language source) changed since the red commit. With `test_sides` (nodeid ->
    `cardgate.testside` of this run), a record is rejected where a test-side file of a bound
    test differs from the record's and so does something that test reads from it."""
    found: dict[str, list[str]] = {}
    notes: dict[str, list[str]] = {}
    rejected: list[str] = []
    if head is None:
        return RedEvidence({}, ())
    for record in evidence.records(root, card.id):
        s = record.summary
        if s.get("phase") != "red":
            continue
        name = record.path.name
        problem = _red_problem(root, record, card, head, modules)
        if problem:
            rejected.append(f"{name}: {problem}")
            continue
        lines = record.report_lines()
        failed_by_assertion = {
            line["nodeid"]
            for line in lines
            if line.get("when") == "call"
            and line.get("outcome") == "failed"
            and line.get("failure") == "assertion"
        }
        red_sources = {
            line["nodeid"]: line["source_sha256"] for line in lines if line.get("source_sha256")
        }
        red_sides = {
            line["nodeid"]: line["test_side"]
            for line in lines
            if isinstance(line.get("test_side"), dict)
        }
        # each Red item on its own: the run may have failed on another one (a Red item whose
        # tests already pass), which says nothing about this one's red result
        red_as_expected = {i.get("key") for i in s.get("items") or () if i.get("status") == "pass"}
        for key, nodeids in (s.get("red_failures") or {}).items():
            if key not in red_as_expected:
                rejected.append(f"{name}: {key}: not red as expected in that run")
                continue
            valid = set(nodeids) & failed_by_assertion & set(bound.get(key, ()))
            if not valid:
                rejected.append(f"{name}: {key}: no bound test of the item failed by assertion")
                continue
            changed = sorted(
                n
                for n in set(bound.get(key, ())) & set(red_sources)
                if sources is not None and n in sources and sources[n] != red_sources[n]
            )
            if changed and not allow_changed:
                more = f" (+{len(changed) - 1} more)" if len(changed) > 1 else ""
                rejected.append(
                    f"{name}: {key}: bound test {changed[0]}{more} changed since the red record "
                    "(--allow-changed-tests accepts it, and the record says so)"
                )
                continue
            if changed:
                notes.setdefault(key, []).append(
                    f"{len(changed)} bound tests changed since red (accepted)"
                )
            moved = test_side_changes(set(bound.get(key, ())), red_sides, test_sides or {})
            if moved and not allow_changed:
                rejected.append(
                    f"{name}: {key}: {moved[0]} since the red record: the bound test checks "
                    "something else now (--allow-changed-tests accepts it, and the record says so)"
                )
                continue
            if moved:
                notes.setdefault(key, []).append(
                    f"test side changed since red (accepted): {moved[0]}"
                )
            found.setdefault(key, []).append(f"{record.commit[:10]} {name}")
    return RedEvidence(
        {k: tuple(v) for k, v in found.items()},
        tuple(rejected),
        {k: tuple(v) for k, v in notes.items()},
    )


def test_side_changes(
    nodeids: set[str], red: dict[str, dict[str, Any]], now: dict[str, dict[str, Any]]
) -> list[str]:
    """What changed on the test side of these tests between a red record and this run, where
    it changes what a test checks: a test-side file differs (module, conftest, fixture file)
    and so does a name the test reads from one or a fixture it uses. Records from before
    test sides are not compared."""
    out: list[str] = []
    for nodeid in sorted(nodeids & set(red) & set(now)):
        old, new = red[nodeid], now[nodeid]
        old_files, new_files = old.get("files") or {}, new.get("files") or {}
        files = {f for f in {*old_files, *new_files} if old_files.get(f) != new_files.get(f)}
        if not files:
            continue
        old_deps, new_deps = old.get("deps") or {}, new.get("deps") or {}
        for dep in sorted({*old_deps, *new_deps}):
            if old_deps.get(dep) == new_deps.get(dep):
                continue
            label, _, where = dep.rpartition(" (")
            how = "is new" if dep not in old_deps else "is gone" if dep not in new_deps else ""
            verb = "used" if label.startswith("fixture ") else "read"
            out.append(
                f"{where.rstrip(')')} changed: {label}, {verb} by {nodeid}, {how or 'differs'}"
            )
    return out


def implementation_changes(changed: list[str], modules: tuple[str, ...] | None) -> list[str]:
    """The changed files that count as implementation. Without a module list: every file but
    tests, cards, evidence and docs. With one: files the bound tests imported, and sources of
    compiled code (`COMPILED_SOURCES`: no import names them)."""
    candidates = [f for f in changed if not NOT_IMPLEMENTATION.search(f)]
    if modules is None:
        return candidates
    imported = set(modules)
    return [f for f in candidates if f in imported or f.endswith(COMPILED_SOURCES)]


def _red_problem(
    root: Path, record: evidence.Record, card: Card, head: str, modules: tuple[str, ...] | None
) -> str:
    s = record.summary
    if not record.intact:
        return "not a record the gate wrote (digest missing or wrong)"
    if record.card != card.id:
        return f"record of {record.card}, not {card.id}"
    if s.get("dirty"):
        return "not a clean red run (dirty working tree)"
    failed = [c for c in s.get("checks") or () if c.get("status") == "fail"]
    if failed:
        first = failed[0]
        return (
            f"a check failed in that run ({first.get('name')}: "
            f"{str(first.get('reason', ''))[:200]}): a red run with a failed check proves nothing"
        )
    commit = gitutil.resolve(root, record.commit)
    if commit is None or not gitutil.is_strict_ancestor(root, commit, head):
        return f"commit {record.commit[:10]!r} is not a strict ancestor of HEAD"
    changed = gitutil.changed_files(root, commit, head)
    if not implementation_changes(changed, modules):
        if modules is None:
            return (
                "no implementation file changed since the red commit (only tests, cards, evidence)"
            )
        shown = ", ".join(changed[:5]) + (" ..." if len(changed) > 5 else "")
        return (
            "no implementation file changed since the red commit: no file the bound tests "
            f"import changed (changed: {shown or 'nothing'})"
        )
    return ""
