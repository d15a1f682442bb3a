"""The gate: `python -m cardgate gate ID [--phase red|green] [--dry-run] [--commit]`.

Four stages, each in its own module, passing typed values:

1. `preflight`: lint (the card's own errors: exit 3; other cards' errors: hold), git state,
   dependencies (verified done cards only), the per-card lock, nothing written yet.
2. `run`: a collection pass over the whole suite finds every test bound to the card, then
   pytest runs those tests and writes a JSON report.
3. `decide`: every item gets pass / hold / fail; card-level checks; the worst decides.
4. `record` (not on `--dry-run`): evidence under `worklog/evidence/<ID>/`, and on a green pass
   the card is ticked, validated and moved to `done/` (committed with `--commit`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TextIO

from cardgate.decide import decide
from cardgate.outcome import GateReport, Recorded
from cardgate.preflight import GateOptions, card_lock, preflight
from cardgate.record import Timing, record
from cardgate.run import run_pytest


def run_gate(
    opts: GateOptions, out: Callable[[str], None] = print, stream: TextIO | None = None
) -> GateReport:
    """Run the four stages; raises `GateUsageError` (exit 3) before writing anything."""
    root = opts.root.resolve()
    with card_lock(root, opts.card_id):
        started = datetime.now(UTC)
        pre = preflight(opts)
        run = run_pytest(opts, pre, out, stream or sys.stdout)
        outcome = decide(pre, run, opts.phase)
        timing = Timing(started, datetime.now(UTC))
        if opts.dry_run:
            return GateReport(outcome)
        recorded = record(pre, opts, run, outcome, timing)
        return GateReport(outcome, recorded)


__all__ = ["GateOptions", "GateReport", "Recorded", "run_gate"]
