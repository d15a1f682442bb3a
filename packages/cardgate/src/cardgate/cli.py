"""`python -m cardgate gate|board|lint`: exit 0 pass, 1 fail, 2 hold, 3 usage or lint error."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from cardgate.board import load_board
from cardgate.gate import EXIT_CODES, GateOptions, GateUsageError, run_gate
from cardgate.render import board_json, board_table, gate_summary


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cardgate", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gate = sub.add_parser("gate", help="run a card's tests, record evidence, move it on pass")
    gate.add_argument("card_id", metavar="ID")
    gate.add_argument("--phase", choices=("red", "green"), default="green")
    gate.add_argument("--dry-run", action="store_true", help="decide, but write nothing")
    gate.add_argument("--root", type=Path, default=Path("."), help="repository root")
    gate.add_argument("-n", "--numprocesses", dest="workers", help="pytest-xdist workers")
    gate.add_argument("--json", action="store_true", help="print the decision as JSON")
    parser.epilog = "Arguments after '--' go to pytest (gate only)."
    board = sub.add_parser("board", help="the lanes as a table")
    board.add_argument("--root", type=Path, default=Path("."))
    fmt = board.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true")
    fmt.add_argument("--markdown", action="store_true")
    lint = sub.add_parser("lint", help="lint every card (exit 3 on errors)")
    lint.add_argument("--root", type=Path, default=Path("."))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    args = build_parser().parse_args(argv)
    if extra and args.command != "gate":
        print("cardgate: error: extra pytest args only go to 'gate'", file=sys.stderr)
        return EXIT_CODES["error"]
    if args.command == "board":
        board = load_board(args.root)
        if args.json:
            print(board_json(board, args.root.resolve()))
        else:
            print(board_table(board, args.root.resolve(), markdown=args.markdown))
        return 0
    if args.command == "lint":
        board = load_board(args.root)
        for error in board.errors:
            print(error)
        print(f"{len(board.cards)} cards, {len(board.errors)} lint errors")
        return EXIT_CODES["error"] if board.errors else 0
    opts = GateOptions(
        card_id=args.card_id,
        root=args.root,
        phase=args.phase,
        dry_run=args.dry_run,
        workers=args.workers,
        pytest_args=extra,
    )
    try:
        result = run_gate(opts)
    except GateUsageError as exc:
        print(f"cardgate: error: {exc}", file=sys.stderr)
        return EXIT_CODES["error"]
    print(gate_summary(result))
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    return result.exit_code
