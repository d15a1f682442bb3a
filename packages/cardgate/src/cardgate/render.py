"""Terminal views: the gate summary and the board table."""

from __future__ import annotations

from typing import Any

from cardgate.board import Board, board_rows
from cardgate.outcome import GateReport, Phase, Verdict


def gate_summary(report: GateReport) -> str:
    o = report.outcome
    lines = [f"== cardgate {o.card_id} ({o.phase.value}) =="]
    lines.append("items:")
    for v in o.items:
        indent = "  " * v.depth
        phase = f"[{v.phase}] " if v.phase else ""
        lines.append(f"  {v.status.label}  {indent}{phase}{v.key}: {v.reason}")
        lines.append(f"        {indent}text: {v.text}")
        if v.tests:
            lines.append(f"        {indent}tests: {', '.join(v.tests)}")
        if v.hint:
            lines.append(f"        {indent}bind a test: {v.hint}")
    totals = {s: sum(1 for v in o.items if v.status is s) for s in Verdict}
    lines.append(
        f"totals: {len(o.items)} items: {totals[Verdict.PASS]} pass, "
        f"{totals[Verdict.HOLD]} hold, {totals[Verdict.FAIL]} fail"
    )
    lines.append(
        "note: a ticked box counts only for (manual) items; other items need passing bound tests."
    )
    if any(v.phase == "red" for v in o.items) and o.phase is Phase.GREEN:
        lines.append("note: Red items also need a red record (--phase red at an earlier commit).")
    lines.append("checks:")
    for c in o.checks:
        lines.append(f"  {c.status.label}  {c.name}: {c.reason}")
    skipped = [g for g in o.thresholds if not g.applicable]
    if skipped:
        lines.append(f"gate rules that did not apply ({len(skipped)}):")
        lines.extend(f"  n/a   {g.metric} {g.check}: {g.message} ({g.source})" for g in skipped)
    if o.phase is Phase.RED and o.red_failures:
        lines.append("red record:")
        for red in o.red_failures:
            lines.append(f"  {red.key}: {', '.join(red.nodeids)}")
    rec = report.recorded
    lines.append(f"decision: {o.verdict.label} (exit {report.exit_code})")
    lines.append(f"evidence: {rec.evidence_dir or '(dry run: nothing written)'}")
    if rec.moved_to:
        lines.append(f"moved to: {rec.moved_to}")
        if rec.committed:
            lines.append(f"committed: {rec.committed} (card move and evidence)")
        else:
            lines.append("staged with its evidence. Commit both:")
            paths = " ".join([*rec.card_paths, rec.evidence_dir or ""])
            lines.append(
                f'  git commit -m "{o.card_id}: done (cardgate pass, {rec.evidence_dir})" '
                f"-- {paths}"
            )
    return "\n".join(lines)


_COLUMNS = [
    ("lane", "Lane"),
    ("id", "Card"),
    ("priority", "Prio"),
    ("depends_on", "Depends on"),
    ("bound", "Bound"),
    ("unbound", "Unbound"),
    ("manual", "Manual"),
    ("verified", "Verified"),
    ("last_gate", "Last gate"),
    ("title", "Title"),
]


def _cell(value: Any) -> str:
    if isinstance(value, list):
        return ", ".join(value) or "-"
    if isinstance(value, dict):
        return f"{value['outcome']} ({value['phase']})"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    return "-" if value is None else str(value)


def board_table(board: Board, markdown: bool = False) -> str:
    data = board_rows(board)
    rows = [[_cell(r[k]) for k, _ in _COLUMNS] for r in data]
    header = [title for _, title in _COLUMNS]
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
    else:
        widths = [max(len(x) for x in col) for col in zip(header, *rows, strict=False)]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        lines = [fmt.format(*header).rstrip(), fmt.format(*["-" * w for w in widths])]
        lines += [fmt.format(*row).rstrip() for row in rows]
    flags = [f"  {r['id']}: {f}" for r in data for f in r["flags"]]
    if flags:
        lines += ["", f"{len(flags)} flags:", *flags]
    if board.errors:
        lines.append("")
        lines.append(f"{len(board.errors)} lint errors:")
        lines += [f"  {e}" for e in board.errors]
    return "\n".join(lines)
