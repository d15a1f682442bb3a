"""`python -m cardgate gate|verify|board|lint`: exit 0 pass, 1 fail, 2 hold, 3 usage or lint
error (`verify`: 0 verified / the re-run agrees, 1 not, 3 nothing to verify)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from cardgate import privacy
from cardgate.board import board_json, load_board
from cardgate.gate import GateOptions, run_gate
from cardgate.outcome import Decision, GateUsageError, Phase
from cardgate.render import board_table, gate_summary
from cardgate.rerun import rerun_card, rerun_summary
from cardgate.verify import verify_card

EXIT_HELP = """\
exit codes: 0 pass, 1 fail, 2 hold (missing evidence), 3 usage or lint error (also a bad
command line). The last line printed is always `cardgate: decision=<pass|fail|hold|usage>
exit=<n>` (on stderr with --json, where stdout holds only the JSON).
Arguments after `--` go to pytest (gate only), e.g. `cardgate gate P0-000 -- -x`; tests bound
to the card that they keep from running make their items hold."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        print(_final(Decision.USAGE), file=sys.stderr)
        raise SystemExit(Decision.USAGE.exit_code)


def _final(decision: Decision) -> str:
    return f"cardgate: decision={decision.value} exit={decision.exit_code}"


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = _Parser(prog="cardgate", description=__doc__, epilog=EXIT_HELP, formatter_class=fmt)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    gate = sub.add_parser(
        "gate",
        help="run a card's tests, record evidence, move it on pass",
        description="Run a card's bound tests, record evidence, move the card to done/ on pass.",
        epilog=EXIT_HELP,
        formatter_class=fmt,
    )
    gate.add_argument("card_id", metavar="ID")
    gate.add_argument("--phase", choices=[p.value for p in Phase], default=Phase.GREEN.value)
    gate.add_argument("--dry-run", action="store_true", help="decide, but write nothing")
    gate.add_argument(
        "--commit",
        action="store_true",
        help="on pass, commit the card move together with its evidence folder",
    )
    gate.add_argument("--root", type=Path, default=Path("."), help="repository root")
    gate.add_argument("-n", "--numprocesses", dest="workers", help="pytest-xdist workers")
    gate.add_argument(
        "--timeout", type=float, help="seconds per test phase (default: the card's Timeout:)"
    )
    gate.add_argument(
        "--run-limit",
        type=float,
        help="seconds the whole pytest run may take (default: 3 x Timeout: a test, else 3600)",
    )
    gate.add_argument(
        "--allow-changed-tests",
        action="store_true",
        help="accept red records whose bound tests changed since (recorded in the manifest)",
    )
    gate.add_argument("--json", action="store_true", help="print only the decision as JSON")
    gate.add_argument(
        "--decision-file", type=Path, help="also write the final decision line to this file"
    )
    verify = sub.add_parser(
        "verify",
        help="is a done card backed by its evidence; --rerun: re-run its green gate",
        description="Check that a done card is backed by a passing gate record; with --rerun, "
        "re-run its newest green record's gate in a fresh clone of the recorded commit (a "
        "clean room, nothing written into the repository) and compare the decision and every "
        "item with the record. Exit 0 verified / agree, 1 not, 3 nothing to verify.",
    )
    verify.add_argument("card_id", metavar="ID")
    verify.add_argument(
        "--rerun", action="store_true", help="re-run the recorded green gate and compare"
    )
    verify.add_argument("--root", type=Path, default=Path("."), help="repository root")
    verify.add_argument("-n", "--numprocesses", dest="workers", help="pytest-xdist workers")
    board = sub.add_parser("board", help="the lanes as a table")
    board.add_argument("--root", type=Path, default=Path("."))
    out = board.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true")
    out.add_argument("--markdown", action="store_true")
    lint = sub.add_parser(
        "lint", help="lint every card and flag unverified done cards (exit 3 on any)"
    )
    lint.add_argument("--root", type=Path, default=Path("."))
    migrate = sub.add_parser(
        "migrate-paths",
        help="rewrite absolute local paths in worklog/ as repo-relative paths or placeholders "
        "(gate records get a renewed digest and a migration note)",
    )
    migrate.add_argument("--root", type=Path, default=Path("."))
    migrate.add_argument("--dry-run", action="store_true", help="list what would change")
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
        return Decision.USAGE.exit_code
    if args.command == "board":
        if args.json:
            print(json.dumps(board_json(args.root.resolve()), indent=2))
        else:
            print(board_table(load_board(args.root.resolve()), markdown=args.markdown))
        return 0
    if args.command == "lint":
        board = load_board(args.root)
        flags = [
            f"{card.path}:1: {flag}"
            for card in board.cards.values()
            for flag in verify_card(board.root, card).flags
        ]
        private = privacy.scan(args.root.resolve())
        for line in [*map(str, board.errors), *flags, *map(str, private.findings)]:
            print(line)
        print(f"{len(board.cards)} cards, {len(board.errors)} lint errors, {len(flags)} flags")
        print(f"privacy: {len(private.findings)} findings in {private.files} files")
        bad = board.errors or flags or private.findings
        return Decision.USAGE.exit_code if bad else 0
    if args.command == "migrate-paths":
        for line in privacy.migrate(args.root.resolve(), dry_run=args.dry_run):
            print(line)
        return 0
    if args.command == "verify":
        return _verify(args)
    return _gate(args, extra)


def _verify(args: argparse.Namespace) -> int:
    root = args.root.resolve()
    if not args.rerun:
        card = load_board(root).cards.get(args.card_id)
        if card is None or card.lane != "done":
            print(f"cardgate: error: {args.card_id} is not a card in done/", file=sys.stderr)
            return Decision.USAGE.exit_code
        flags = verify_card(root, card).flags
        for flag in flags:
            print(f"{card.path}:1: {flag}")
        print(f"cardgate: verified={'no' if flags else 'yes'} exit={1 if flags else 0}")
        return 1 if flags else 0

    def say(line: str) -> None:
        print(line, flush=True)

    try:
        rerun = rerun_card(root, args.card_id, workers=args.workers, python=sys.executable, out=say)
    except GateUsageError as exc:
        print(f"cardgate: error: {exc}", file=sys.stderr)
        print(f"cardgate: rerun=usage exit={Decision.USAGE.exit_code}", file=sys.stderr)
        return Decision.USAGE.exit_code
    say(rerun_summary(rerun))
    say(f"cardgate: rerun={'agree' if rerun.agrees else 'differ'} exit={rerun.exit_code}")
    return rerun.exit_code


def _gate(args: argparse.Namespace, extra: list[str]) -> int:
    opts = GateOptions(
        card_id=args.card_id,
        root=args.root,
        phase=Phase(args.phase),
        dry_run=args.dry_run,
        commit=args.commit,
        workers=args.workers,
        timeout=args.timeout,
        run_limit=args.run_limit,
        pytest_args=tuple(extra),
        python=sys.executable,
        allow_changed_tests=args.allow_changed_tests,
    )
    out = sys.stderr if args.json else sys.stdout

    def say(line: str) -> None:
        print(line, file=out, flush=True)

    try:
        report = run_gate(opts, say, stream=out)
    except GateUsageError as exc:
        print(f"cardgate: error: {exc}", file=sys.stderr)
        return _finish(args, Decision.USAGE, out)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        say(gate_summary(report))
    return _finish(args, report.decision, out)


def _finish(args: argparse.Namespace, decision: Decision, out: object) -> int:
    line = _final(decision)
    print(line, file=out, flush=True)  # type: ignore[call-overload]
    if args.decision_file is not None:
        args.decision_file.write_text(line + "\n", encoding="utf-8")
    return decision.exit_code
