"""`cardgate verify --rerun ID`: a stranger's re-run of a done card's green gate.

The card's newest passing green record names a commit. The re-run clones the repository into a
temporary folder (`git clone --shared --no-checkout`: the objects are shared, not copied; none of
the repository's local config, attributes file, replace refs, hooks or sparse checkout comes
along), checks that commit out, and runs the gate's own chain there (`gate.run_gate` as a
`--dry-run`: preflight, a clean room of the commit, run, decide; nothing is recorded), with the
recorded timeout and `--allow-changed-tests` and the room's imports redirected from this working
tree as the gate does. The repository's working tree, index, refs and evidence stay as they
were. The decision and every item's status are then compared with the record.

Exit codes: 0 the re-run agrees with the record, 1 it does not (the differences are listed),
3 nothing to re-run (an unknown card, a card not in `done/`, no passing green record, a commit
this repository does not hold).
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from cardgate import evidence, gitutil
from cardgate.board import load_board
from cardgate.gate import run_gate
from cardgate.outcome import GateOutcome, GateReport, GateUsageError, Phase, Verdict
from cardgate.preflight import GateOptions
from cardgate.verify import newest_green

ABSENT = "absent"


@dataclass(frozen=True)
class Difference:
    """One thing the re-run decided otherwise: `what` is `outcome` or an item key."""

    what: str
    recorded: str
    rerun: str
    reason: str = ""

    def __str__(self) -> str:
        why = f" ({self.reason})" if self.reason else ""
        return f"{self.what}: recorded {self.recorded}, re-run {self.rerun}{why}"


@dataclass(frozen=True)
class Rerun:
    card_id: str
    record_dir: str
    commit: str
    report: GateReport
    differences: tuple[Difference, ...]
    seconds: float

    @property
    def agrees(self) -> bool:
        return not self.differences

    @property
    def exit_code(self) -> int:
        return 0 if self.agrees else 1


def compare(summary: dict[str, Any], outcome: GateOutcome) -> list[Difference]:
    """The recorded decision and item statuses against the re-run's."""
    out: list[Difference] = []
    recorded = str(summary.get("outcome", "?"))
    if recorded != outcome.verdict.value:
        bad = [c for c in outcome.checks if c.status is not Verdict.PASS]
        reason = f"{bad[0].name}: {bad[0].reason}" if bad else ""
        out.append(Difference("outcome", recorded, outcome.verdict.value, reason[:300]))
    before = {str(i.get("key")): str(i.get("status")) for i in summary.get("items") or ()}
    after = {v.key: v for v in outcome.items}
    for key in [*before, *(k for k in after if k not in before)]:
        now = after.get(key)
        status = now.status.value if now is not None else ABSENT
        if before.get(key, ABSENT) != status:
            reason = now.reason[:300] if now is not None else ""
            out.append(Difference(key, before.get(key, ABSENT), status, reason))
    return out


def _clone(root: Path, commit: str, dest: Path) -> None:
    """A fresh clone of `root` at `commit`, as a stranger would have it."""
    gitutil.git(root, "clone", "-q", "--shared", "--no-checkout", str(root), str(dest))
    gitutil.git(
        dest,
        "-c",
        "core.attributesFile=/dev/null",
        "--no-replace-objects",
        "checkout",
        "-q",
        "--detach",
        commit,
    )


def _recorded_options(record: evidence.Record) -> tuple[float | None, bool]:
    """The recorded gate's timeout and `--allow-changed-tests` (from its manifest)."""
    manifest = record.manifest()
    timeout = manifest.get("timeout_s")
    return (
        float(timeout) if isinstance(timeout, int | float) and timeout > 0 else None,
        bool(manifest.get("allow_changed_tests")),
    )


def rerun_card(
    root: Path,
    card_id: str,
    *,
    workers: str | None = None,
    python: str = "",
    out: Callable[[str], None] = print,
    stream: TextIO | None = None,
) -> Rerun:
    """Re-run the newest passing green record of a done card; raises `GateUsageError` (exit 3)
    when there is nothing to re-run."""
    root = root.resolve()
    board = load_board(root)
    card = board.cards.get(card_id)
    if card is None:
        raise GateUsageError(f"unknown card {card_id!r}")
    if card.lane != "done":
        raise GateUsageError(f"{card_id} is in {card.lane}/, not done/: nothing to re-run")
    record = newest_green(root, card)
    if record is None:
        raise GateUsageError(f"{card_id} has no passing green record the gate wrote")
    commit = gitutil.resolve(root, record.commit)
    if commit is None:
        raise GateUsageError(f"{record.path.name} names commit {record.commit!r}, unknown here")
    timeout, allow_changed = _recorded_options(record)
    rel = record.path.relative_to(root).as_posix()
    out(f"cardgate: re-running {rel} (commit {commit[:10]}) in a fresh clone")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="cardgate-rerun-") as tmp:
        clone = Path(tmp) / "clone"
        _clone(root, commit, clone)
        opts = GateOptions(
            card_id=card_id,
            root=clone,
            phase=Phase.GREEN,
            dry_run=True,
            workers=workers,
            timeout=timeout,
            python=python or sys.executable,
            allow_changed_tests=allow_changed,
            source=root,
        )
        report = run_gate(opts, out, stream)
    return Rerun(
        card_id=card_id,
        record_dir=rel,
        commit=commit,
        report=report,
        differences=tuple(compare(record.summary, report.outcome)),
        seconds=time.monotonic() - started,
    )


def rerun_summary(rerun: Rerun) -> str:
    head = (
        f"re-run of {rerun.record_dir} at {rerun.commit[:10]}: decision "
        f"{rerun.report.outcome.verdict.value} ({rerun.seconds:.1f} s)"
    )
    if rerun.agrees:
        return f"{head}\nagree: the decision and every item match the record"
    lines = [head, f"differ: {len(rerun.differences)} differences from the record:"]
    lines.extend(f"  {d}" for d in rerun.differences)
    return "\n".join(lines)
