"""The gate: `python -m cardgate gate ID [--phase red|green] [--dry-run] [--commit]`.

Four stages, each in its own module, passing typed values:

1. `preflight`: lint (the card's own errors: exit 3; other cards' errors: hold), git state,
   dependencies (verified done cards only), the per-card lock, nothing written yet.
2. `run`: in a clean room (`cardgate.room`: a fresh checkout of the commit, read from git's
   raw objects; the working tree only when there is no commit), a collection pass over the whole suite finds every test bound to the card, then
   pytest runs those tests and writes a JSON report.
3. `decide`: every item gets pass / hold / fail; card-level checks; the worst decides.
4. `record` (not on `--dry-run`): evidence under `worklog/evidence/<ID>/`, and on a green pass
   the card is ticked, validated and moved to `done/` (committed with `--commit`).
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TextIO

from cardgate.decide import decide
from cardgate.outcome import GateReport, Recorded
from cardgate.preflight import GateOptions, card_lock, preflight
from cardgate.record import Timing, record
from cardgate.room import ROOM_PREFIX, Room, build_room
from cardgate.run import run_pytest


@contextlib.contextmanager
def clean_room(root: Path, commit: str | None) -> Iterator[Room | None]:
    """A fresh checkout of `commit` for the run, removed afterwards (None without a commit)."""
    if commit is None:
        yield None
        return
    with tempfile.TemporaryDirectory(prefix=ROOM_PREFIX) as name:
        yield build_room(root, commit, Path(name).resolve())


def run_gate(
    opts: GateOptions, out: Callable[[str], None] = print, stream: TextIO | None = None
) -> GateReport:
    """Run the four stages; raises `GateUsageError` (exit 3) before writing anything."""
    root = opts.root.resolve()
    with card_lock(root, opts.card_id):
        started = datetime.now(UTC)
        pre = preflight(opts)
        with clean_room(root, pre.commit) as room:
            where = room.path if room else None
            run = run_pytest(opts, pre, out, stream or sys.stdout, where)
            if room is not None:
                run = replace(run, room=room.to_dict())
            outcome = decide(pre, run, opts.phase, where)
        timing = Timing(started, datetime.now(UTC))
        if opts.dry_run:
            return GateReport(outcome)
        recorded = record(pre, opts, run, outcome, timing)
        return GateReport(outcome, recorded)


__all__ = ["GateOptions", "GateReport", "Recorded", "run_gate"]
