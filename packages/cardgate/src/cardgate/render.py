"""Terminal, JSON and markdown views: the gate summary and the board table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cardgate import evidence
from cardgate.board import LANES, Board
from cardgate.card import Card
from cardgate.gate import GateOutcome
from cardgate.scan import scan_bindings

_LABEL = {"pass": "PASS", "hold": "HOLD", "fail": "FAIL"}


def gate_summary(result: GateOutcome) -> str:
    lines = [f"== cardgate {result.card_id} ({result.phase}) =="]
    lines.append("items:")
    for v in result.items:
        indent = "  " * v.depth
        phase = f"[{v.phase}] " if v.phase else ""
        lines.append(f"  {_LABEL[v.status]}  {indent}{phase}{v.key}: {v.reason}")
    lines.append("checks:")
    for c in result.checks:
        lines.append(f"  {_LABEL[c.status]}  {c.name}: {c.reason}")
    skipped = [g for g in result.gates if not g.applicable]
    if skipped:
        lines.append(f"  ({len(skipped)} gate checks not for this hardware)")
    if result.phase == "red" and result.red_failures:
        lines.append("red record:")
        for key, nodes in result.red_failures.items():
            lines.append(f"  {key}: {', '.join(nodes)}")
    lines.append(f"decision: {_LABEL[result.outcome]} (exit {result.exit_code})")
    lines.append(f"evidence: {result.evidence_dir or '(dry run: nothing written)'}")
    if result.moved_to:
        lines.append(f"moved to: {result.moved_to} (staged). Commit it:")
        lines.append(
            f'  git commit -m "{result.card_id}: done (cardgate pass, {result.evidence_dir})" '
            f"-- {' '.join(result.card_paths)}"
        )
    return "\n".join(lines)


def board_rows(board: Board, root: Path) -> list[dict[str, Any]]:
    bound_refs = scan_bindings(root)
    rows = []
    for lane in LANES:
        for card in board.lanes[lane]:
            rows.append(_row(card, lane, root, bound_refs))
    return rows


def _row(card: Card, lane: str, root: Path, refs: list[tuple[str, str]]) -> dict[str, Any]:
    bound_keys = {item.key for cid, ref in refs if cid == card.id and (item := card.lookup(ref))}
    leaves = card.leaves()
    manual = [i for i in leaves if i.manual]
    bound = [i for i in leaves if not i.manual and i.key in bound_keys]
    last = evidence.last_record(root, card.id)
    return {
        "id": card.id,
        "title": card.title,
        "lane": lane,
        "priority": card.priority,
        "depends_on": card.depends_on,
        "items": len(leaves),
        "bound": len(bound),
        "manual": len(manual),
        "unbound": len(leaves) - len(bound) - len(manual),
        "last_gate": f"{last.outcome} ({last.phase})" if last else None,
        "last_evidence": last.path.relative_to(root).as_posix() if last else None,
        "path": card.path,
    }


def board_json(board: Board, root: Path) -> str:
    data = {
        "cards": board_rows(board, root),
        "errors": [str(e) for e in board.errors],
    }
    return json.dumps(data, indent=2)


_COLUMNS = [
    ("lane", "Lane"),
    ("id", "Card"),
    ("priority", "Prio"),
    ("depends_on", "Depends on"),
    ("bound", "Bound"),
    ("unbound", "Unbound"),
    ("manual", "Manual"),
    ("last_gate", "Last gate"),
    ("title", "Title"),
]


def _cell(value: Any) -> str:
    if isinstance(value, list):
        return ", ".join(value) or "-"
    return "-" if value is None else str(value)


def board_table(board: Board, root: Path, markdown: bool = False) -> str:
    rows = [[_cell(r[k]) for k, _ in _COLUMNS] for r in board_rows(board, root)]
    header = [title for _, title in _COLUMNS]
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
    else:
        widths = [max(len(x) for x in col) for col in zip(header, *rows, strict=False)]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        lines = [fmt.format(*header).rstrip(), fmt.format(*["-" * w for w in widths])]
        lines += [fmt.format(*row).rstrip() for row in rows]
    if board.errors:
        lines.append("")
        lines.append(f"{len(board.errors)} lint errors:")
        lines += [f"  {e}" for e in board.errors]
    return "\n".join(lines)
