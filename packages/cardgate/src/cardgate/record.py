"""Gate stage 4: evidence (never overwritten, world-readable, repo-relative) and the card move.

On a green pass the card is ticked, gets a fresh `## Validation` section, `Status: done` and
moves to `done/` (a card already in `done/` is re-gated in place: its previous gate-written
Validation section is replaced). `summary.json` records `card_sha256` of the card text as it is
after these edits, which is what `verify` checks. With `commit=True` the gate commits the card
move together with the evidence folder; otherwise it stages both and prints the command.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from cardgate import __version__, edit, evidence, gitutil, hardware
from cardgate.board import KANBAN_DIR
from cardgate.card import Card
from cardgate.outcome import GateOutcome, GateReport, Phase, Recorded, Verdict
from cardgate.preflight import GateOptions, Preflight
from cardgate.redact import redact
from cardgate.run import RunResult
from cardgate.verify import file_sha256


@dataclass(frozen=True)
class Timing:
    started: datetime
    finished: datetime


def manifest(
    pre: Preflight, opts: GateOptions, run: RunResult, timing: Timing, card_sha256: str
) -> dict[str, Any]:
    card = pre.card
    return {
        "cardgate": __version__,
        "card": card.id,
        "card_path": card.path,
        "card_sha256": card_sha256,
        "gated_card_sha256": file_sha256(pre.root / card.path),
        "phase": opts.phase.value,
        "commit": pre.commit,
        "dirty": bool(pre.dirty),
        "dirty_files": list(pre.dirty[:200]),
        "started_utc": timing.started.isoformat(timespec="microseconds"),
        "finished_utc": timing.finished.isoformat(timespec="seconds"),
        "pytest_command": [_relative(a, pre.root) for a in run.command],
        "pytest_args": [*(["-n", opts.workers] if opts.workers else []), *opts.pytest_args],
        "timeout_s": pre.timeout,
        "env": dict(run.env),
        "env_dropped": list(run.env_dropped),
        "clean_room": run.room,
        "bound_tests": {k: list(v) for k, v in sorted(run.bound.items())},
        "static_bound_files": list(run.static_files),
        "static_bound_tests": _static_tests(run),
        "test_side_files": run.test_side_files(),
        "allow_changed_tests": opts.allow_changed_tests,
        **run.inventory.to_dict(),
        **hardware.describe(),
    }


def _static_tests(run: RunResult) -> dict[str, list[str]]:
    """item key -> `path::name:line` of each test function the static scan bound to it."""
    out: dict[str, list[str]] = {}
    for test in run.static_tests:
        out.setdefault(test.key, []).append(f"{test.nodeid}:{test.first}")
    return dict(sorted(out.items()))


def _relative(arg: str, root: Path) -> str:
    """A command-line argument without absolute paths (the repo is `.`, the report `<tmp>`)."""
    if arg.startswith("--cardgate-report="):
        return "--cardgate-report=<tmp>/report.json"
    return redact(arg, root)


def _closed_text(pre: Preflight, outcome: GateOutcome, record_dir: str, day: str) -> str:
    card = pre.card
    text = (pre.root / card.path).read_text(encoding="utf-8")
    to_tick = [card.items[v.key].line for v in outcome.items if not card.items[v.key].checked]
    text = edit.tick(text, to_tick)
    text = edit.set_status(text, card.field_lines.get("status"), "done")
    return edit.replace_validation(
        text,
        day,
        [
            f"Gate: pass (`python -m cardgate gate {card.id}`)",
            f"Commit: `{outcome.commit}`",
            f"Evidence: `{record_dir}/`",
        ],
    )


def record(
    pre: Preflight, opts: GateOptions, run: RunResult, outcome: GateOutcome, timing: Timing
) -> Recorded:
    root, card = pre.root, pre.card
    short = outcome.commit[:7] if outcome.commit else "nogit"
    record_dir = evidence.create_record_dir(root, card.id, short, opts.phase.value, timing.started)
    rel_dir = record_dir.relative_to(root).as_posix()
    closing = outcome.verdict is Verdict.PASS and opts.phase is Phase.GREEN
    text = (
        _closed_text(pre, outcome, rel_dir, timing.started.strftime("%Y-%m-%d"))
        if closing
        else (root / card.path).read_text(encoding="utf-8")
    )
    target = f"{KANBAN_DIR}/done/{Path(card.path).name}" if closing else card.path
    sha = hashlib.sha256(text.encode("utf-8")).hexdigest()
    evidence.write_json(record_dir / "manifest.json", manifest(pre, opts, run, timing, sha))
    evidence.write_jsonl(
        record_dir / "report.jsonl",
        [{k: v for k, v in rec.items() if k != "metrics"} for rec in run.raw_tests],
    )
    metrics = [m for p in run.phases for m in p.metrics]
    evidence.write_json(
        record_dir / "metrics.json",
        {
            "hardware": run.hardware,
            "metrics": {m.name: m.value for m in metrics},
            "records": [
                {
                    "name": m.name,
                    "value": m.value,
                    "unit": m.unit,
                    "higher_is_better": m.higher_is_better,
                    "nodeid": m.nodeid,
                }
                for m in metrics
            ],
            "gates": [g.to_dict() for g in outcome.thresholds],
        },
    )
    recorded = Recorded(evidence_dir=rel_dir, card_sha256=sha, moved_to=None)
    summary = GateReport(outcome, recorded).to_dict()
    summary.update(
        {
            "card_path": target,
            "dirty": bool(outcome.dirty),
            "started_utc": timing.started.isoformat(timespec="microseconds"),
            "finished_utc": timing.finished.isoformat(timespec="seconds"),
        }
    )
    evidence.write_summary(record_dir, summary)
    if not closing:
        return recorded
    paths = _move(root, card, target, text)
    committed = None
    if opts.commit:
        gitutil.git(root, "add", "--", rel_dir)
        message = f"{card.id}: done (cardgate pass, {rel_dir})"
        gitutil.git(root, "commit", "-q", "-m", message, "--", *paths, rel_dir)
        committed = gitutil.head(root)
    else:
        gitutil.git(root, "add", "--", rel_dir)
    return Recorded(
        evidence_dir=rel_dir,
        moved_to=target,
        card_paths=tuple(paths),
        card_sha256=sha,
        committed=committed,
    )


def _move(root: Path, card: Card, target: str, text: str) -> list[str]:
    if card.lane != "done":
        (root / target).parent.mkdir(parents=True, exist_ok=True)
        gitutil.git(root, "mv", card.path, target)
    (root / target).write_text(text, encoding="utf-8")
    gitutil.git(root, "add", "--", target)
    return [card.path, target] if target != card.path else [target]
