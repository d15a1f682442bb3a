"""The board: every card under `kanban/<lane>/*.md`, plus the lint rules that span cards.

Board lint (on top of each card's parse errors): a file outside the four lanes, duplicate card
ids across lanes, a `Status:` that disagrees with the lane folder, a `Depends on:` naming no
card (or the card itself), dependency cycles, a `Gates:` path that does not exist and a gates
file under another name than the default (`worklog/gates/<ID>.yml`).

`board_json(root)` is the board as data (also `python -m cardgate board --json`): per card its
lane, items, bindings, `verified` (done cards backed by a gate record for their current text;
null outside done/), `flags` and `last_gate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cardgate import evidence
from cardgate.card import STATUSES, Card, CardError, parse_card
from cardgate.claims import unchecked_claims
from cardgate.scan import scan_bindings, unreadable_markers
from cardgate.thresholds import GateFormatError, load_gates, never_matching
from cardgate.verify import verify_card

LANES: tuple[str, ...] = STATUSES
KANBAN_DIR = "kanban"
GATES_DIR = "worklog/gates"


@dataclass
class Board:
    root: Path
    cards: dict[str, Card] = field(default_factory=dict)
    lanes: dict[str, list[Card]] = field(default_factory=lambda: {lane: [] for lane in LANES})
    errors: list[CardError] = field(default_factory=list)
    files: list[str] = field(default_factory=list)

    def errors_for(self, path: str) -> list[CardError]:
        return sorted(e for e in self.errors if e.path == path)

    def card_errors(self, card_id: str) -> list[CardError]:
        card = self.cards.get(card_id)
        return self.errors_for(card.path) if card is not None else []


def rel(path: Path, root: Path) -> str:
    try:
        return path.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return path.as_posix()


def card_files(root: Path) -> list[Path]:
    base = root / KANBAN_DIR
    if not base.is_dir():
        return []
    return sorted(p for p in base.rglob("*.md") if p.parent != base)


def load_board(root: Path | str) -> Board:
    """Parse and lint every card of `<root>/kanban`. Never raises on malformed cards."""
    root = Path(root)
    board = Board(root=root)
    seen: dict[str, Card] = {}
    for path in card_files(root):
        where = rel(path, root)
        board.files.append(where)
        lane = path.parent.name
        if path.parent.parent != root / KANBAN_DIR or lane not in LANES:
            board.errors.append(
                CardError(where, 0, f"card outside the lanes ({', '.join(LANES)}): move it")
            )
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            board.errors.append(CardError(where, 0, f"unreadable card: {exc}"))
            continue
        result = parse_card(text, where)
        board.errors.extend(result.errors)
        card = result.card
        if card is None:
            continue
        card.lane = lane
        if card.id in seen:
            first = seen[card.id]
            board.errors.append(
                CardError(where, 1, f"duplicate card id {card.id} (also {first.path}:1)")
            )
            board.errors.append(
                CardError(first.path, 1, f"duplicate card id {card.id} (also {where}:1)")
            )
            continue
        seen[card.id] = card
        board.lanes[lane].append(card)
        status_line = card.field_lines.get("status", 1)
        if card.status is None:
            board.errors.append(CardError(where, 1, "missing 'Status:' header field"))
        elif card.status in LANES and card.status != lane:
            board.errors.append(
                CardError(
                    where,
                    status_line,
                    f"Status {card.status!r} disagrees with lane folder {lane!r}",
                )
            )
    board.cards = seen
    _lint_dependencies(board)
    _lint_gates_files(board)
    _lint_evidence(board)
    board.errors.extend(
        CardError(
            m.path,
            m.line,
            f"card marker argument {m.source!r} cannot be read without "
            "running the module: write the card id and item as string literals or "
            "module-level constants",
        )
        for m in unreadable_markers(root)
    )
    board.errors = sorted(set(board.errors))
    return board


def _lint_gates_files(board: Board) -> None:
    gates_dir = board.root / GATES_DIR
    for card in board.cards.values():
        line = card.field_lines.get("gates", 1)
        for path in card.gates:
            if not (board.root / path).is_file():
                board.errors.append(CardError(card.path, line, f"Gates: {path!r} does not exist"))
        default = f"{GATES_DIR}/{card.id}.yaml"
        if card.gates and (board.root / default).is_file() and default not in card.gates:
            board.errors.append(
                CardError(
                    card.path,
                    line,
                    f"{default} exists but 'Gates:' does not name it, so the gate would not "
                    "read it: name it in 'Gates:' too, or remove it",
                )
            )
        _lint_gate_rules(board, card, line)
        if card.gates or not gates_dir.is_dir():
            continue
        for other in sorted(gates_dir.glob(f"{card.id}.*")):
            if other.name != f"{card.id}.yaml":
                board.errors.append(
                    CardError(
                        card.path,
                        line,
                        f"{GATES_DIR}/{other.name} is not read (the default is "
                        f"{GATES_DIR}/{card.id}.yaml): rename it or name it in 'Gates:'",
                    )
                )


def _lint_gate_rules(board: Board, card: Card, line: int) -> None:
    paths = card.gates or [f"{GATES_DIR}/{card.id}.yaml"]
    files = [board.root / p for p in paths if (board.root / p).is_file()]
    try:
        gates = load_gates(*files, root=board.root)
    except (GateFormatError, OSError) as exc:
        board.errors.append(CardError(card.path, line, f"gates: {exc}"))
        return
    board.errors.extend(CardError(card.path, line, message) for message in never_matching(gates))
    board.errors.extend(
        CardError(card.path, n, message) for n, message in unchecked_claims(card, gates)
    )


def _lint_evidence(board: Board) -> None:
    for card in board.cards.values():
        for path, why in evidence.refused_records(board.root, card.id):
            name = path.relative_to(board.root).as_posix()
            board.errors.append(CardError(card.path, 1, f"evidence record {name} refused: {why}"))


def _lint_dependencies(board: Board) -> None:
    for card in board.cards.values():
        line = card.field_lines.get("depends on", 1)
        for dep in card.depends_on:
            if dep == card.id:
                board.errors.append(CardError(card.path, line, f"{card.id} depends on itself"))
            elif dep not in board.cards:
                board.errors.append(
                    CardError(card.path, line, f"'Depends on' names unknown card {dep}")
                )
    state: dict[str, int] = {}

    def visit(card_id: str, trail: list[str]) -> None:
        state[card_id] = 1
        for dep in board.cards[card_id].depends_on:
            if dep not in board.cards or dep == card_id:
                continue
            if state.get(dep) == 1:
                cycle = " -> ".join([*trail[trail.index(dep) :], dep])
                card = board.cards[card_id]
                line = card.field_lines.get("depends on", 1)
                board.errors.append(CardError(card.path, line, f"dependency cycle: {cycle}"))
            elif dep not in state:
                visit(dep, [*trail, dep])
        state[card_id] = 2

    for card_id in board.cards:
        if card_id not in state:
            visit(card_id, [card_id])


def board_rows(board: Board) -> list[dict[str, Any]]:
    refs = scan_bindings(board.root)
    rows = []
    for lane in LANES:
        for card in board.lanes[lane]:
            bound_keys = {i.key for cid, ref in refs if cid == card.id and (i := card.lookup(ref))}
            leaves = card.leaves()
            manual = [i for i in leaves if i.manual]
            bound = [i for i in leaves if not i.manual and i.key in bound_keys]
            check = verify_card(board.root, card)
            rows.append(
                {
                    "id": card.id,
                    "title": card.title,
                    "lane": lane,
                    "priority": card.priority,
                    "depends_on": card.depends_on,
                    "items": len(leaves),
                    "bound": len(bound),
                    "manual": len(manual),
                    "unbound": len(leaves) - len(bound) - len(manual),
                    "verified": check.verified,
                    "flags": list(check.flags),
                    "last_gate": check.last_gate.to_dict() if check.last_gate else None,
                    "path": card.path,
                }
            )
    return rows


def board_json(root: Path | str) -> dict[str, Any]:
    """The board as JSON-ready data: `{"cards": [...], "errors": [...]}` (see module doc)."""
    board = load_board(root)
    return {"cards": board_rows(board), "errors": [str(e) for e in board.errors]}
